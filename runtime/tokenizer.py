"""Text <-> token ids, built on the ``tokenizers`` library.

Two sources: an HF model folder (``tokenizer.json`` and its companion files) or the vocabulary and
merges stored in a GGUF file's metadata.  Either way the result is one :class:`Tokenizer` that can
``save`` itself back into a folder, which is how a GGUF's tokenizer lands in the model store.

BOS is never added by the ``tokenizers`` post-processor: :meth:`Tokenizer.encode` adds it itself, so
that a folder's post-processor and a GGUF's ``add_bos_token`` flag behave the same way.

:class:`IncrementalDecoder` turns a stream of generated ids into printable text.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from localllm.errors import LocalLLMError

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

#: Tokenizer models (``tokenizer.ggml.model``) that :meth:`Tokenizer.from_gguf_metadata` builds.
SUPPORTED_GGUF_MODELS = ("gpt2", "llama")

# Pre-tokenizer split regexes, as llama.cpp spells them (llama-vocab.cpp) for each `tokenizer.ggml.pre`.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (GPT-4o; gpt-oss's o200k_harmony): case runs, contractions kept on their word, numbers of 1-3 digits.
O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Families of `tokenizer.ggml.pre` values that share a pre-tokenizer.
_PRE_GPT2 = ("default", "gpt2", "gpt-2")
_PRE_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r")  # each digit alone, then GPT-2's regex
_PRE_LLAMA3 = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3")
_PRE_QWEN2 = ("qwen2", "deepseek-r1-qwen", "megrez")
_PRE_O200K = ("gpt-4o", "llama4")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet byte-level BPE vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus what generation needs: BOS/EOS ids and the chat template."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_id: int | None,
        eos_ids: Iterable[int],
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self._tk = backend
        self.bos_id = bos_id
        self.eos_ids: list[int] = list(dict.fromkeys(int(i) for i in eos_ids))
        self.add_bos = bool(add_bos and bos_id is not None)
        self.chat_template = chat_template

    # ----------------------------------------------------------------------------------- loading
    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Load an HF model folder (or one written by :meth:`save`).

        Reads ``tokenizer.json`` (required), ``tokenizer_config.json``, ``special_tokens_map.json``,
        ``generation_config.json`` (its ``eos_token_id`` ids stop generation too) and a chat template
        from ``chat_template.jinja``, ``chat_template.json`` or ``tokenizer_config.json``, first found.
        """
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise LocalLLMError(
                f"no tokenizer.json in {folder}",
                "the model folder needs the fast-tokenizer file tokenizer.json; download it with the "
                "weights (localllm pull REPO) or save one with transformers' tokenizer.save_pretrained()",
            )
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the library raises a bare Exception on a bad file
            raise LocalLLMError(f"cannot read {tok_file}: {exc}", "re-download the model's tokenizer files") from exc

        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        gen_config = _read_json(folder / "generation_config.json")

        bos_token = _token_text(config.get("bos_token")) or _token_text(special_map.get("bos_token"))
        eos_token = _token_text(config.get("eos_token")) or _token_text(special_map.get("eos_token"))
        bos_id = backend.token_to_id(bos_token) if bos_token else None
        if bos_id is None and isinstance(gen_config.get("bos_token_id"), int):
            bos_id = gen_config["bos_token_id"]

        eos_ids: list[int] = []
        if eos_token and backend.token_to_id(eos_token) is not None:
            eos_ids.append(backend.token_to_id(eos_token))
        eos_ids += _int_list(config.get("localllm_eos_token_ids"))
        eos_ids += _int_list(gen_config.get("eos_token_id"))

        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            # No flag: add BOS when the folder's own post-processor would have added it.
            add_bos = bos_id is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos_id]

        return cls(
            backend,
            bos_id=bos_id,
            eos_ids=eos_ids,
            add_bos=add_bos,
            chat_template=_folder_chat_template(folder, config),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build the tokenizer a GGUF file describes (``tokenizer.ggml.*`` metadata as Python values).

        ``gpt2`` (byte-level BPE, the pre-tokenizer picked from ``tokenizer.ggml.pre``) and ``llama``
        (sentencepiece-style BPE with byte fallback, merges rebuilt from the scores) are supported.
        """
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] | None = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise LocalLLMError("the GGUF file has no tokenizer vocabulary", "use a GGUF converted with its tokenizer")
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
        if kind == "gpt2":
            backend = _byte_level_bpe(tokens, types, meta)
            default_add_bos = False
        elif kind == "llama":
            backend = _sentencepiece_bpe(tokens, types, meta)
            default_add_bos = True  # llama.cpp's default for this vocabulary when the file says nothing
        else:
            raise LocalLLMError(
                f"unsupported GGUF tokenizer model {kind!r}",
                f"supported tokenizer models: {', '.join(SUPPORTED_GGUF_MODELS)}",
            )
        _register_added_tokens(backend, tokens, types)

        def token_id(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return int(value) if isinstance(value, int) and 0 <= value < len(tokens) else None

        bos_id = token_id("bos_token_id")
        eos_ids = [i for i in (token_id("eos_token_id"), token_id("eot_token_id"), token_id("eom_token_id")) if i is not None]
        add_bos = meta.get("tokenizer.ggml.add_bos_token", default_add_bos)
        template = meta.get("tokenizer.chat_template")
        if template is None:  # a file without its template (Gemma 3 270M): the family's turn format
            from localllm.runtime.chat import builtin_template

            template = builtin_template(lambda t: backend.token_to_id(t) is not None)
        end_of_turn = backend.token_to_id("<end_of_turn>")  # Gemma ends a turn with it (llama.cpp's EOT)
        if end_of_turn is not None:
            eos_ids.append(end_of_turn)
        return cls(backend, bos_id=bos_id, eos_ids=eos_ids, add_bos=bool(add_bos), chat_template=template)

    def save(self, folder: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json``; :meth:`from_folder` reads them back identically.

        All stop ids go under ``localllm_eos_token_ids`` (HF's ``eos_token`` holds only one).
        """
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        self._tk.save(str(out / "tokenizer.json"))
        config = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos,
            "localllm_eos_token_ids": self.eos_ids,
            "chat_template": self.chat_template,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    # ------------------------------------------------------------------------------- using
    @property
    def vocab_size(self) -> int:
        return self._tk.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self._tk.id_to_token(self.bos_id) if self.bos_id is not None else None

    @property
    def eos_token(self) -> str | None:
        """The first stop token's text (the one chat templates know as ``eos_token``)."""
        return self._tk.id_to_token(self.eos_ids[0]) if self.eos_ids else None

    @property
    def backend(self) -> HFTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tk

    def encode(self, text: str, *, add_special: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it (``<|im_start|>``) become their ids.

        BOS is prepended only when the model wants it (``add_bos``) and ``add_special`` is true.
        Text that is not valid Unicode (lone surrogates: undecodable bytes that Python carried
        through ``surrogateescape``, or ``\\ud800`` escapes in JSON) is refused, never guessed at.
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise LocalLLMError(
                f"the text is not valid UTF-8 (undecodable character at position {e.start})",
                "send UTF-8 text (or decode it with replacement characters first)",
            ) from None
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tk.id_to_token(token_id)

    def stream(self, *, skip_special: bool = False, context: Sequence[int] = ()) -> IncrementalDecoder:
        """An :class:`IncrementalDecoder` for text generated after ``context`` (e.g. the prompt ids)."""
        return IncrementalDecoder(self, skip_special=skip_special, context=context)


class IncrementalDecoder:
    """Feed generated ids one at a time; get back the new text to print.

    Each step decodes only a short window: the tokens of the last emitted piece (the *prefix*, kept
    as context so decoders that strip a leading space or merge bytes see what came before) plus the
    tokens not yet emitted, and prints what the window adds to the prefix's text.  Text ending in
    U+FFFD is held back: its last token carried only part of a UTF-8 character.  The printed pieces
    concatenate to ``decode(all ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False, context: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        tail = list(context)[-4:]  # a few prompt tokens so the first piece keeps its leading space
        self._ids: list[int] = tail  # the window: prefix tokens, then pending tokens
        self._read = len(tail)  # where the pending tokens start in the window

    def _text(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special=self._skip_special)

    def feed(self, token_id: int) -> str:
        """Add one token; return the text that is complete now ('' while a character is unfinished)."""
        self._ids.append(int(token_id))
        prefix = self._text(self._ids[: self._read])
        text = self._text(self._ids)
        if len(text) <= len(prefix) or text.endswith("\ufffd"):
            return ""
        # The emitted tokens become the next prefix; older ones are dropped to keep each step O(1).
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """What is still held back at the end (an unfinished character comes out as U+FFFD)."""
        prefix = self._text(self._ids[: self._read])
        text = self._text(self._ids)
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return text[len(prefix) :]


# ---------------------------------------------------------------------------------- GGUF helpers
def _byte_level_bpe(tokens: list[str], types: list[int], meta: dict[str, Any]) -> HFTokenizer:
    """GPT-2 style byte-level BPE from a GGUF vocabulary and merges."""
    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise LocalLLMError("the GGUF file has a byte-level (gpt2) vocabulary but no merges", "re-convert the model")
    alphabet = set(bytes_to_unicode().values())
    spell = bytes_to_unicode()
    vocab: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, types)):
        # Ordinary tokens are stored in the byte alphabet; a stray one that is not gets respelled so
        # BPE can reach it.  Control / user-defined tokens keep their text: they are matched whole.
        if kind not in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spell[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    pre = str(meta.get("tokenizer.ggml.pre") or "default")
    backend = HFTokenizer(
        models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False, ignore_merges=pre in _PRE_LLAMA3)
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _PRE_GPT2:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in _PRE_DIGITS_THEN_GPT2:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    elif pre in _PRE_LLAMA3:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"), byte_level])
    elif pre in _PRE_QWEN2:
        backend.normalizer = normalizers.NFC()
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), "isolated"), byte_level])
    elif pre in _PRE_O200K:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(O200K_SPLIT), "isolated"),
                                                         byte_level])
    else:
        warnings.warn(
            f"GGUF pre-tokenizer {pre!r} is not known to localllm; using GPT-2's split, "
            "so some texts may tokenize differently from llama.cpp",
            stacklevel=3,
        )
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], types: list[int], meta: dict[str, Any]) -> HFTokenizer:
    """A sentencepiece-style (``llama``) vocabulary as BPE with byte fallback, like HF's LlamaTokenizer.

    GGUF files of this kind usually carry scores, not merges: the merges are rebuilt from them, best
    merged-token score first (llama.cpp merges the best-scoring pair first, which is the same order).

    The space prefix follows transformers (Metaspace, ``prepend_scheme="first"``): one ``▁`` before the
    text unless it already starts with a space, none after special tokens.  llama.cpp instead prefixes
    a space to every text fragment after a special token, as HF's legacy Llama tokenizer did; a GGUF
    does not say which one its model was trained with.
    """
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    if meta.get("tokenizer.ggml.merges"):
        pairs = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if not scores:
            raise LocalLLMError("the GGUF sentencepiece vocabulary has neither merges nor scores", "re-convert the model")
        pairs = _merges_from_scores(tokens, types, scores, vocab)
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    backend = HFTokenizer(models.BPE(vocab, pairs, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(
    tokens: list[str], types: list[int], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Every split of a normal token into two vocabulary pieces, best merged-token score first."""
    found: list[tuple[float, int, int, str, str]] = []
    for token, kind, score in zip(tokens, types, scores):
        if kind != TOKEN_NORMAL:
            continue
        local = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        found += [(-score, -len(left), -len(right), left, right) for left, right in local]
    found.sort(key=lambda m: m[:3])  # stable: ties keep vocabulary order
    return [(left, right) for *_, left, right in found]


def _register_added_tokens(backend: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens become special tokens, user-defined ones plain added tokens.

    Both are matched whole in the input text, so ``<|im_start|>`` encodes to its one id.  They are in
    the model vocabulary already, so ``tokenizers`` keeps their ids.
    """
    special = [
        AddedToken(t, normalized=False, special=True)
        for t, k in zip(tokens, types)
        if k in (TOKEN_CONTROL, TOKEN_UNKNOWN)
    ]
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)


# -------------------------------------------------------------------------------- folder helpers
def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's contents, or {} when the file is absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LocalLLMError(f"cannot read {path}: {exc}", "re-download the model's tokenizer files") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string, or an AddedToken dict with 'content'."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _int_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _folder_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, chat_template.json, then tokenizer_config.json."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
