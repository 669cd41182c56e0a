"""A jinja2 sandbox whose renders end, and end small.

A chat template comes with the model's files, so it is untrusted code: jinja2's immutable sandbox
keeps it from Python's internals, and this environment keeps it from the CPU and the memory. Python
cannot stop a thread, so the render stops itself: every attribute or item read, call, filter,
intercepted operator, loop element and piece of output is a step, counted against a step budget and a
CPU-time budget; every piece of text written (to the prompt, or to a macro's or block's buffer) and
every value an operator, filter or string method makes counts towards the text the render has made;
and an operation that would make one huge value (``'a' * 10**9``, ``10**(10**10)``, ``'%999999999d' % 1``,
``'x'|center(10**9)``, ``s.ljust(10**9)``) is refused from its operands' sizes, before it runs.

Everything goes through jinja's own hooks: the sandbox's ``call``, ``getattr``, ``getitem`` and
``call_binop``, wrapped filters and globals, and a code generator that routes loops, ``~`` and output
through the environment. Templates render exactly as they do without these checks.
"""

from __future__ import annotations

import functools
import re
import string
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment

try:
    import resource

    _RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)
except ImportError:  # Windows
    _RUSAGE_THREAD = None

def _thread_cpu_seconds() -> float:
    """The calling thread's CPU time: through getrusage where the system has it per thread (Linux), for
    time.thread_time's clock can take milliseconds to read on some virtual machines."""
    if _RUSAGE_THREAD is None:
        return time.thread_time()
    usage = resource.getrusage(_RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime


#: What an element of a list, tuple, dict or set counts for besides its own text (a pointer's bytes).
_ELEMENT = 8
#: The most bits an integer a template computes may have: far more than any template's arithmetic, and
#: few enough digits for Python to write it out.
MAX_INT_BITS = 1 << 13


@dataclass(frozen=True)
class RenderLimits:
    """What one render may spend.

    ``steps``: attribute and item reads, calls, filters, operators, loop elements and outputs;
    ``cpu_seconds``: the rendering thread's CPU time; ``value_chars``: the prompt, and any one value the
    template makes (a container's elements count ``8`` each besides their text); ``work_chars``: all
    the text and values the render makes along the way. Real templates use a tiny fraction of each.
    """

    steps: int = 1_000_000
    cpu_seconds: float = 1.0
    value_chars: int = 4 << 20
    work_chars: int = 32 << 20

    def for_input(self, chars: int) -> RenderLimits:
        """The limits for a conversation (messages, tools) of ``chars`` (:func:`approx_size`): a long
        one takes more steps and time, and makes a longer prompt."""
        steps = -(-(self.steps + chars // 4) // 100_000) * 100_000  # round: the limit is quoted in messages
        return replace(self, steps=steps, cpu_seconds=round(self.cpu_seconds + chars / (4 << 20), 1),
                       value_chars=self.value_chars + 2 * chars, work_chars=self.work_chars + 16 * chars)


class TemplateLimitError(Exception):
    """A render went past one of its :class:`RenderLimits`; ``str()`` says which, as a predicate
    ("ran past its limit of ...") for a sentence about the template."""


def approx_size(value: Any, cap: int, indent: int = 0) -> int:
    """Roughly the characters ``value`` takes as text: its strings' lengths plus ``8`` (and ``indent``
    per level of nesting) for each element of its lists, tuples, dicts and sets, shared ones counted
    each time they appear. Stops counting once past ``cap`` (and returns more than ``cap``), so a huge
    or cyclic value costs no more than ``cap / 8`` elements."""
    if isinstance(value, (str, bytes)):
        return len(value)
    total = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, (list, tuple, set, frozenset, dict)):
            total += len(item) * (_ELEMENT + depth * indent)
            if total > cap:
                return total
            if isinstance(item, dict):
                stack.extend((x, depth + 1) for pair in item.items() for x in pair)
            else:
                stack.extend((x, depth + 1) for x in item)
        elif item is value:
            total += _ELEMENT
        if total > cap:
            return total
    return total


def _length(value: Any) -> int:
    """The number of elements of a list, tuple, dict or set; 1 for anything else."""
    return len(value) if isinstance(value, (list, tuple, set, frozenset, dict)) else 1


def _mb(chars: int) -> str:
    return f"{chars / (1 << 20):,.0f} MB" if chars >= 1 << 20 else f"{chars:,} characters"


def _arg(args: tuple[Any, ...], kwargs: Mapping[str, Any], index: int, name: str, default: Any = None) -> Any:
    """A call's argument: ``args[index]``, else ``kwargs[name]``, else ``default``."""
    return args[index] if len(args) > index else kwargs.get(name, default)


def _replaced_size(s: Any, old: Any, new: Any, count: Any) -> int | None:
    """The exact length of ``s.replace(old, new, count)``, or None where that is not a plain string case."""
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return None
    found = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        found = min(found, count)
    return len(s) + found * max(0, len(new) - len(old))


#: ``%`` conversions: flags, width and precision (either may be ``*``: taken from the arguments).
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
#: A run of digits in a ``str.format`` field's spec: a width or a precision.
_DIGITS = re.compile(r"\d+")


def _number(digits: str) -> int:
    """A width or precision written in a format; past 18 digits, just huge (Python refuses to read an
    integer of thousands of digits)."""
    return int(digits) if len(digits) <= 18 else 10**18


def _percent_size(fmt: Any, values: Any) -> int | None:
    """An upper bound on the length of ``fmt % values`` for a string ``fmt`` (None for arithmetic)."""
    if not isinstance(fmt, (str, bytes)):
        return None
    text = fmt.decode("latin-1") if isinstance(fmt, bytes) else fmt
    numbers = values if isinstance(values, tuple) else (values,)
    star = max((v for v in numbers if isinstance(v, int)), default=0)
    widths = 0
    for width, precision in _PERCENT_SPEC.findall(text):
        for part in (width, precision):
            widths += star if part == "*" else _number(part) if part else 0
    return len(text) + widths + approx_size(values, 1 << 40)


def _format_size(fmt: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    """An upper bound on the length of ``fmt.format(*args, **kwargs)``: its text, its arguments, and
    every width and precision its fields ask for (nested ``{}`` in a spec: the largest integer argument)."""
    values = (*args, *kwargs.values())
    largest = max((v for v in values if isinstance(v, int)), default=0)
    widths = 0
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is not None and spec:
            widths += sum(_number(d) for d in _DIGITS.findall(spec)) + (largest if "{" in spec else 0)
    return len(fmt) + widths + approx_size(values, 1 << 40)


class RenderBudget:
    """One render's counts against its :class:`RenderLimits`."""

    def __init__(self, limits: RenderLimits, timed: bool = True) -> None:
        self.limits = limits
        self.value_chars = limits.value_chars
        self.steps = 0
        self.work = 0
        self.cpu_end = _thread_cpu_seconds() + limits.cpu_seconds if timed else None

    def step(self, n: int = 1) -> None:
        """Count ``n`` steps; check the CPU time every 1024 steps (and on any larger charge)."""
        self.steps += n
        if self.steps > self.limits.steps:
            raise TemplateLimitError(f"ran past its limit of {self.limits.steps:,} steps (a loop or recursion "
                                     "that runs too long)")
        if (n > 1 or not self.steps & 1023) and self.cpu_end is not None and _thread_cpu_seconds() > self.cpu_end:
            raise TemplateLimitError(f"ran past its limit of {self.limits.cpu_seconds:g} s of CPU time")

    def size(self, value: Any) -> int:
        """:func:`approx_size`, counted up to just past the limit of one value."""
        return len(value) if type(value) is str else approx_size(value, self.value_chars)

    def check_size(self, estimate: int | None, what: str | Callable[[], str]) -> None:
        """Refuse an operation (``what`` made it, or says so when called) whose result would take
        ``estimate`` characters, more than one value may."""
        if estimate is not None and estimate > self.value_chars:
            raise TemplateLimitError(f"tried to make a value of about {_mb(estimate)} with "
                                     f"{what if isinstance(what, str) else what()}, over the "
                                     f"{_mb(self.value_chars)} one value may take")

    def made(self, value: Any, what: str | Callable[[], str]) -> Any:
        """Refuse a value an operation made that is too big; count what it newly takes (its text, or
        its elements: those it shares with other values were counted when they were made) as work."""
        size = self.size(value)
        self.check_size(size, what)
        self.work += size if isinstance(value, (str, bytes)) else _ELEMENT * _length(value)
        if self.work > self.limits.work_chars:
            raise TemplateLimitError(f"made more than {_mb(self.limits.work_chars)} of text and values, its "
                                     "limit for this conversation")
        if size > 1 << 16:
            self.step(2)  # a big value: check the CPU time now
        return value


#: The render running in this context (a thread renders one template at a time). Outside a render
#: (jinja folds constant expressions while it compiles) each check gets a fresh, untimed budget.
_ACTIVE: ContextVar[RenderBudget | None] = ContextVar("localllm_template_render", default=None)


def _budget() -> RenderBudget:
    return _ACTIVE.get() or RenderBudget(RenderLimits(), timed=False)


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles a template so that its loops count their elements, its ``~`` checks what it makes,
    and every piece of output (in the prompt, a macro or a block) is counted: through the
    environment's :meth:`BoundedEnvironment.loop_items`, ``made_text`` and ``output``."""

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        node.iter = nodes.Call(nodes.EnvironmentAttribute("loop_items"), [node.iter], [], None, None,
                               lineno=node.iter.lineno)
        super().visit_For(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.made_text(")
        super().visit_Concat(node, frame)
        self.write(")")

    def _output_child_pre(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        self.write("environment.output(")
        super()._output_child_pre(node, frame, finalize)

    def _output_child_post(self, node: nodes.Expr, frame: Frame, finalize: Any) -> None:
        super()._output_child_post(node, frame, finalize)
        self.write(")")

    def _output_const_repr(self, group: Iterable[Any]) -> str:
        return f"environment.output({super()._output_const_repr(group)})"


def _filter_checks() -> dict[str, Callable[[RenderBudget, list[Any], dict[str, Any]], int | None]]:
    """For each filter that can make far more than it is given: the most characters its result can
    take, from its arguments (the value first, then the filter's own), or None where it cannot tell."""

    def center(b: RenderBudget, a: list[Any], k: dict[str, Any]) -> int | None:
        width = _arg(tuple(a), k, 1, "width", 80)
        return max(b.size(a[0]), width) if isinstance(width, int) else None

    def indent(b: RenderBudget, a: list[Any], k: dict[str, Any]) -> int | None:
        s, width = a[0], _arg(tuple(a), k, 1, "width", 4)
        width = len(width) if isinstance(width, str) else width
        if not isinstance(s, str) or not isinstance(width, int):
            return None
        return len(s) + (s.count("\n") + 1) * width

    def wordwrap(b: RenderBudget, a: list[Any], k: dict[str, Any]) -> int | None:
        s, width = a[0], _arg(tuple(a), k, 1, "width", 79)
        wrap = _arg(tuple(a), k, 3, "wrapstring") or "\n"
        if not isinstance(s, str) or not isinstance(width, int) or width < 1:
            return None
        return len(s) + (len(s) // width + s.count("\n") + 1) * b.size(wrap)

    def replace_(b: RenderBudget, a: list[Any], k: dict[str, Any]) -> int | None:
        t = tuple(a)
        return _replaced_size(a[0], _arg(t, k, 1, "old"), _arg(t, k, 2, "new"), _arg(t, k, 3, "count"))

    def join(b: RenderBudget, a: list[Any], k: dict[str, Any]) -> int | None:
        if not isinstance(a[0], (list, tuple, set, frozenset, dict, str)):
            a[0] = list(a[0])  # a generator: count what it yields (each element took its own steps)
        return b.size(a[0]) + len(a[0]) * b.size(_arg(tuple(a), k, 1, "d", ""))

    def format_(b: RenderBudget, a: list[Any], k: dict[str, Any]) -> int | None:
        return _percent_size(a[0], dict(k) if k else tuple(a[1:]))

    def batch(b: RenderBudget, a: list[Any], k: dict[str, Any]) -> int | None:
        count, fill = _arg(tuple(a), k, 1, "linecount"), _arg(tuple(a), k, 2, "fill_with")
        pad = count * (_ELEMENT + b.size(fill)) if isinstance(count, int) and fill is not None else 0
        return b.size(a[0]) * 2 + max(0, pad)

    def slice_(b: RenderBudget, a: list[Any], k: dict[str, Any]) -> int | None:
        slices = _arg(tuple(a), k, 1, "slices")
        return b.size(a[0]) * 2 + (max(0, slices) * _ELEMENT * 2 if isinstance(slices, int) else 0)

    def sum_(b: RenderBudget, a: list[Any], k: dict[str, Any]) -> int | None:
        start = _arg(tuple(a), k, 2, "start", 0)
        if isinstance(start, (int, float)):
            return None
        if not isinstance(a[0], (list, tuple)):
            a[0] = list(a[0])
        whole = b.size(a[0]) + b.size(start)
        b.step(len(a[0]) * (whole // _ELEMENT) // 2)  # adding sequences copies the sum so far each time
        return whole

    def tojson(b: RenderBudget, a: list[Any], k: dict[str, Any]) -> int | None:
        indent = _arg(tuple(a), k, 2, "indent")
        indent = len(indent) if isinstance(indent, str) else indent if isinstance(indent, int) else 0
        ascii_ = _arg(tuple(a), k, 1, "ensure_ascii", False)
        return approx_size(a[0], b.value_chars, indent=max(0, indent) + 1) * (6 if ascii_ else 2)

    def escaped(b: RenderBudget, a: list[Any], k: dict[str, Any]) -> int | None:
        if isinstance(a[0], str):  # '&' becomes '&amp;', '"' '&#34;': 4 more at most
            return len(a[0]) + 4 * sum(a[0].count(c) for c in "&<>\"'")
        return b.size(a[0]) * 6

    def printed(b: RenderBudget, a: list[Any], k: dict[str, Any]) -> int | None:
        if isinstance(a[0], str):
            return len(a[0])
        return approx_size(a[0], b.value_chars, indent=2) * 4  # repr writes a character in up to 4

    return {"center": center, "indent": indent, "wordwrap": wordwrap, "replace": replace_, "join": join,
            "format": format_, "batch": batch, "slice": slice_, "sum": sum_, "tojson": tojson,
            "e": escaped, "escape": escaped, "forceescape": escaped, "xmlattr": escaped, "urlencode": escaped,
            "urlize": escaped, "string": printed, "pprint": printed}


_FILTER_CHECKS = _filter_checks()


def _text_method(obj: Any) -> tuple[str, str | bytes] | None:
    """(name, the string) for a string's method (``str.format`` as the sandbox wraps it too)."""
    target = getattr(obj, "__wrapped__", obj)
    owner = getattr(target, "__self__", None)
    if isinstance(target, types.BuiltinMethodType) and isinstance(owner, (str, bytes)):
        return target.__name__, owner
    return None


def _check_text_method(b: RenderBudget, method: tuple[str, str | bytes], args: tuple[Any, ...],
                       kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """Refuse a string method whose result would be too big (``center``, ``ljust``, ``rjust``, ``zfill``,
    ``expandtabs``, ``replace``, ``join``, ``translate``, ``format``, ``format_map``); the arguments to
    call it with (a generator given to ``join``, listed)."""
    name, s = method
    estimate: int | None = None
    if name in ("center", "ljust", "rjust", "zfill"):
        width = _arg(args, kwargs, 0, "width")
        estimate = max(len(s), width) if isinstance(width, int) else None
    elif name == "expandtabs":
        tabsize = _arg(args, kwargs, 0, "tabsize", 8)
        tabs = s.count("\t") if isinstance(s, str) else s.count(b"\t")
        estimate = len(s) + tabs * tabsize if isinstance(tabsize, int) else None
    elif name == "replace":
        estimate = _replaced_size(s, _arg(args, kwargs, 0, "old"), _arg(args, kwargs, 1, "new"),
                                  _arg(args, kwargs, 2, "count"))
    elif name == "join" and args:
        items = args[0] if isinstance(args[0], (list, tuple, str, bytes)) else list(args[0])
        args = (items, *args[1:])
        estimate = b.size(items) + len(items) * len(s)
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((b.size(v) for v in args[0].values()), default=1)
        estimate = len(s) * max(1, longest)
    elif name == "format" and isinstance(s, str):
        estimate = _format_size(s, args, kwargs)
    elif name == "format_map" and isinstance(s, str) and args and isinstance(args[0], Mapping):
        estimate = _format_size(s, (), args[0])
    b.check_size(estimate, f"{name}()")
    return args


def _check_binop(b: RenderBudget, operator: str, left: Any, right: Any) -> None:
    """Refuse ``left operator right`` (``+``, ``*``, ``**``, ``%``) where its result would be too big."""
    what = f"'{operator}'"
    bits = 0
    if operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            bits = right * abs(left).bit_length()
    elif operator == "*":
        if isinstance(left, int) and isinstance(right, int):
            bits = abs(left).bit_length() + abs(right).bit_length()
        elif isinstance(right, int) and not isinstance(left, (int, float)):
            b.check_size(b.size(left) * max(0, right), what)
        elif isinstance(left, int) and not isinstance(right, (int, float)):
            b.check_size(b.size(right) * max(0, left), what)
    elif operator == "%":
        b.check_size(_percent_size(left, right), what)
    elif not isinstance(left, (int, float)):  # '+' of text or sequences
        b.check_size(b.size(left) + b.size(right), what)
    if bits > MAX_INT_BITS:
        raise TemplateLimitError(f"tried to make a number of about {bits:,} bits with '{operator}', over the "
                                 f"{MAX_INT_BITS:,} a number may take")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """An immutable sandbox whose renders (:meth:`render`) each run under their own
    :class:`RenderLimits`, raising :class:`TemplateLimitError` once one goes past a limit; see the
    module's docstring. Its templates can be rendered again, and from several threads at once.

    ``extra_filters`` and ``extra_globals`` are added to jinja's own, and bounded like them.
    """

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self, *, extra_filters: Mapping[str, Callable[..., Any]] | None = None,
                 extra_globals: Mapping[str, Any] | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.filters.update(extra_filters or {})
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals.update(extra_globals or {})
        self.globals["range"] = _range
        self.globals["lipsum"] = _lipsum

    def render(self, template: jinja2.Template, variables: Mapping[str, Any], limits: RenderLimits) -> str:
        """``template`` (compiled by this environment) rendered with ``variables`` within ``limits``."""
        budget = RenderBudget(limits)
        token = _ACTIVE.set(budget)
        parts: list[str] = []
        size = 0
        try:
            for chunk in template.generate(variables):
                size += len(chunk)
                if size > budget.value_chars:
                    raise TemplateLimitError(f"wrote more than {_mb(budget.value_chars)} of prompt, its limit "
                                             "for this conversation")
                parts.append(chunk)
        finally:
            _ACTIVE.reset(token)
        return "".join(parts)

    # -------------------------------------------------------------------------------- generated code's hooks
    def output(self, text: str) -> str:
        """A piece of output (of the prompt, a macro or a block): a step, and work."""
        b = _budget()
        b.step()
        return b.made(text, "its output")

    def made_text(self, text: str) -> str:
        """The result of ``~``."""
        b = _budget()
        b.step()
        return b.made(text, "'~'")

    def loop_items(self, iterable: Any) -> Any:
        """What a ``for`` loop iterates: its length in steps now, or a step for each element it yields."""
        try:
            length = len(iterable)
        except TypeError:
            return _counted(iterable)
        _budget().step(max(1, length))
        return iterable

    # -------------------------------------------------------------------------------- sandbox hooks
    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().step()
        return super().getitem(obj, argument)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's naming)
        if getattr(__obj, "__func__", None) is BoundedEnvironment.loop_items:
            return __obj(*args)
        b = _budget()
        b.step()
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level
            args = (__self.loop_items(args[0]), *args[1:])
        method = _text_method(__obj)
        if method is not None:
            args = _check_text_method(b, method, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        what = lambda: f"{getattr(__obj, '__name__', type(__obj).__name__)}()"  # noqa: E731
        if method is not None:
            return b.made(result, what)
        b.check_size(b.size(result), what)  # a macro's text was counted as it was written
        return result

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _budget()
        b.step()
        if operator == "+" and type(left) is str and type(right) is str:  # most of a template's operators
            return b.made(left + right, "'+'")
        _check_binop(b, operator, left, right)
        return b.made(super().call_binop(context, operator, left, right), f"'{operator}'")


def _counted(iterable: Iterable[Any]) -> Iterator[Any]:
    for item in iterable:
        _budget().step()
        yield item


def _bounded_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` as a bounded filter: a step, its result checked and counted, and for the filters that
    can make far more than they are given, the result's size checked before it runs."""
    check = _FILTER_CHECKS.get(name)
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0  # context or environment first
    what = f"the filter '{name}'"

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        b = _budget()
        b.step()
        if check is not None and len(args) > skip:
            rest = list(args[skip:])
            b.check_size(check(b, rest, kwargs), what)
            args = (*args[:skip], *rest)
        return b.made(func(*args, **kwargs), what)

    return bounded


def _range(*args: int) -> range:
    """The sandbox's ``range`` (at most 100000 numbers), each number a step."""
    numbers = jinja2.sandbox.safe_range(*args)
    _budget().step(max(1, len(numbers)))
    return numbers


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (jinja's names)
    """jinja's ``lipsum``, refused where it would write more than a value may take."""
    b = _budget()
    if isinstance(n, int) and isinstance(max, int):
        b.check_size(n * max * 12, "lipsum()")
    return b.made(jinja2.utils.generate_lorem_ipsum(n, html, min, max), "lipsum()")
