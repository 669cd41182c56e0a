"""Placing a MoE model's experts between GPU and CPU memory (loaders.placement, loaders.memory_plan):
which layers' experts stay in CPU RAM for given byte budgets, the flags, a CPU run, and the refusal."""

from __future__ import annotations

import pytest
import torch

from localllm.loaders.memory_plan import RUNTIME_BYTES, Footprint, cheapest_fix, plan_for, refusal
from localllm.loaders.placement import ExpertChoice, LayerChoice, Placement, host_expert_modules
from localllm.runtime.config import ModelConfig

GPU, CPU = torch.device("cuda"), torch.device("cpu")
MB = 10**6
#: 6 layers, layer 2 dense (its MLP is not sparse: no experts to place).
CONFIG = ModelConfig(vocab_size=384, dim=64, n_layers=6, n_heads=4, n_kv_heads=2, intermediate_size=192,
                     max_seq_len=4096, n_experts=8, n_active=2, expert_size=32)
EXPERTS = (10 * MB, 10 * MB, 0, 10 * MB, 10 * MB, 10 * MB)
LOTS = (10**12, "test")


def footprint(device: torch.device = GPU) -> Footprint:
    return Footprint(CONFIG, "int4", 80 * MB, torch.bfloat16, device, EXPERTS)


def plan(available: int, device: torch.device = GPU, host: int = 10**12, **choice) -> object:
    return plan_for(footprint(device), 1024, available=(available, "test"), host_available=(host, "test"),
                    experts=ExpertChoice(**choice))


def test_automatic_placement_keeps_the_fewest_first_layers_experts_in_cpu_ram() -> None:
    whole = plan(10**12)
    assert whole.placement.n_cpu_moe == 0 and whole.host_weights == 0 and whole.fits
    everything = whole.total  # all on the GPU
    # 20 MB short: the experts of layers 0 and 1 go to CPU RAM; 25 MB short: layer 2 is dense, so layer 3's too
    for short, layers in [(1, (0,)), (20 * MB, (0, 1)), (20 * MB + 1, (0, 1, 3)), (35 * MB, (0, 1, 3, 4))]:
        p = plan(everything - short)
        assert p.placement.host_layers == layers, short
        assert p.host_weights == 10 * MB * len(layers) and p.total == everything - p.host_weights
        assert p.fits and p.placement.chosen_by == "automatic" and p.n_cpu_moe == p.placement.n_cpu_moe
        assert p.host_total == p.host_weights + RUNTIME_BYTES["cpu"]
    # nothing fits even with every expert in CPU RAM: all of them there, and it does not fit
    p = plan(everything - 60 * MB)
    assert p.placement.host_layers == (0, 1, 3, 4, 5) and not p.fits
    # the CPU's RAM must hold them
    assert not plan(everything - 20 * MB, host=20 * MB + RUNTIME_BYTES["cpu"] - 1).fits
    assert plan(everything - 20 * MB, host=20 * MB + RUNTIME_BYTES["cpu"]).fits


def test_gguf_block_experts_stay_in_cpu_ram_unless_a_flag_says_otherwise() -> None:
    """No GPU kernel multiplies GGUF-block experts in place (the reference would decode them through the
    host every step): the automatic plan keeps all of them in CPU RAM, even where the GPU holds them."""
    from dataclasses import replace

    from localllm.loaders.placement import experts_run_on_host
    from localllm.quant.experts import QuantExperts
    from localllm.quant.formats import gguf_scheme, parse_scheme

    blocks = replace(footprint(), experts_on_host=True)
    p = plan_for(blocks, 1024, available=LOTS, host_available=LOTS)
    assert p.placement.host_layers == (0, 1, 3, 4, 5) and p.placement.chosen_by.startswith("automatic: no GPU kernel")
    assert plan_for(blocks, 1024, available=LOTS, host_available=LOTS,
                    experts=ExpertChoice(n_cpu_moe=0)).placement.host_layers == ()  # a flag still decides
    with torch.device("meta"):
        assert experts_run_on_host(torch.nn.ModuleList([QuantExperts(4, 256, 64, gguf_scheme("Q4_K"))]))
        assert not experts_run_on_host(torch.nn.ModuleList([QuantExperts(4, 256, 64, parse_scheme("int4"))]))


def test_the_flags_place_what_they_say() -> None:
    p = plan(10**12, n_cpu_moe=3)  # layers 0-2, of which 2 is dense
    assert p.placement.host_layers == (0, 1) and p.placement.chosen_by == "--n-cpu-moe 3"
    assert p.host_weights == 20 * MB
    p = plan(10**12, cpu_moe=True)
    assert p.placement.host_layers == (0, 1, 3, 4, 5) and p.placement.chosen_by == "--cpu-moe"
    assert plan(10**12, n_cpu_moe=99).placement.host_layers == (0, 1, 3, 4, 5)
    assert plan(10**12, n_cpu_moe=0).host_weights == 0
    assert host_expert_modules(4, EXPERTS) == {"layers.0.mlp.experts", "layers.1.mlp.experts", "layers.3.mlp.experts"}


def test_a_cpu_run_or_a_dense_model_is_placed_whole() -> None:
    for choice in ({}, {"cpu_moe": True}, {"n_cpu_moe": 2}):
        p = plan(10**12, device=CPU, **choice)
        assert p.placement is None and p.host_weights == 0 and p.n_cpu_moe == 0
    dense = Footprint(CONFIG, "int4", 80 * MB, torch.bfloat16, GPU, ())
    for choice in (ExpertChoice(), ExpertChoice(cpu_moe=True)):
        where = plan_for(dense, 1024, available=LOTS, host_available=LOTS, experts=choice).placement
        assert not where.split and where.host_layers == () and where.describe() == ["all layers on cuda"]


def test_where_each_part_lives_is_said_with_the_reason() -> None:
    everything = plan(10**12).total
    lines = plan(everything - 20 * MB).placement.describe()
    assert lines[0] == "embeddings, attention, norms, routers, shared experts, head, KV cache on cuda"
    assert lines[1].startswith("experts of layers 0-1 in CPU RAM, run on the CPU (20 MB; automatic; cuda memory: ")
    assert lines[1].endswith("free, experts 10 MB a layer)")
    assert lines[2] == "experts of layers 3-5 on cuda"
    assert plan(10**12, cpu_moe=True).placement.describe()[1].startswith("experts of layers 0-1, 3-5 in CPU RAM")
    assert Placement("cpu", EXPERTS, 0, "cpu").describe() == ["all parts in CPU RAM (a CPU run)"]


def test_a_plan_that_does_not_fit_names_its_numbers_and_the_cheapest_change() -> None:
    everything = plan(10**12).total
    short = plan(everything - 20 * MB, n_cpu_moe=1)  # layer 0's experts are not enough
    assert not short.fits
    assert cheapest_fix(None, short, footprint(), None) == "use --n-cpu-moe 2, or free memory"
    message = refusal("qwen3-moe", short)
    assert message.startswith("qwen3-moe needs ") and "in CPU RAM" in message and "experts of 1 layers 10 MB" in message
    # every expert in CPU RAM and still short: a shorter context (the plan places the experts again)
    tight = plan(everything - 50 * MB - 1)
    assert not tight.fits and tight.placement.host_layers == (0, 1, 3, 4, 5)
    fix = cheapest_fix(None, tight, footprint(), None)
    assert fix.startswith("use --ctx ") and int(fix.split()[2]) < 1024
    # the CPU's RAM too small for the experts: said beside the GPU's numbers
    ram = plan(everything - 20 * MB, host=MB)
    assert not ram.fits and "; in CPU RAM " in refusal("m", ram)


@pytest.mark.parametrize("n,layers", [(0, "--n-cpu-moe 0"), (3, "--n-cpu-moe 3"), (6, "--cpu-moe")])
def test_the_flag_named_for_a_count(n: int, layers: str) -> None:
    assert ExpertChoice().flag(n, 6) == layers


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    from tests.conftest import hf_folders
    from tests.test_moe import qwen3_moe_model

    return hf_folders({"qwen3_moe": qwen3_moe_model}, "placement-moe", tmp_path_factory)("qwen3_moe")[1]


def test_run_takes_the_flags_and_a_cpu_run_ignores_them(moe_folder) -> None:
    """``--cpu-moe`` / ``--n-cpu-moe`` are accepted by ``run``; on the CPU every part is in RAM already,
    so the run is the same as without them (no placement lines)."""
    from click.testing import CliRunner

    from localllm.cli import main

    for flags in (["--cpu-moe"], ["--n-cpu-moe", "1"]):
        result = CliRunner().invoke(main, ["run", str(moe_folder), "hello", "--raw", "-n", "2", "--no-compile",
                                           "--temperature", "0", "--device", "cpu", "--verbose", *flags])
        assert result.exit_code == 0, result.output
        assert "placement:" not in result.output and "eval count" in result.output
    result = CliRunner().invoke(main, ["run", str(moe_folder), "hello", "--n-cpu-moe", "-1"])
    assert result.exit_code != 0 and "-1" in result.output


def test_run_on_a_gpu_is_refused_with_the_placement_that_fits(moe_folder, monkeypatch) -> None:
    """``run``'s check on a GPU target (no GPU needed: the plan builds on ``meta``): with room for all but
    layer 0's and part of layer 2's experts, ``--n-cpu-moe 1`` does not fit and the fix is ``--cpu-moe``
    (layers 0 and 2 are the sparse ones); the automatic plan takes that placement by itself."""
    from localllm.errors import LocalLLMError
    from localllm.loaders.memory_plan import check_memory, footprint
    from localllm.loaders.load import open_checkpoint
    from localllm.loaders.spec import LoadSpec
    from localllm.quant.target import Target

    gpu = Target(GPU, (8, 9))
    spec = LoadSpec(str(moe_folder), device=gpu, quant="int4")
    fp = footprint(open_checkpoint(str(moe_folder)), spec)
    whole = plan_for(fp, 256, available=LOTS, host_available=LOTS)
    room = whole.total - fp.expert_bytes[0] - fp.expert_bytes[2] // 2
    monkeypatch.setattr("localllm.loaders.memory_plan.available_memory",  # the GPU's free memory; the CPU's
                        lambda device: (room, "test") if device.type == "cuda" else (10**12, "test"))
    with pytest.raises(LocalLLMError) as e:
        check_memory(LoadSpec(str(moe_folder), device=gpu, quant="int4", n_cpu_moe=1))
    assert e.value.hint == "use --cpu-moe, or free memory" and "experts of 1 layers" in e.value.one_line()
    plan = check_memory(spec)
    assert plan.fits and plan.placement.host_layers == (0, 2) and plan.placement.chosen_by == "automatic"


# --------------------------------------------------------------------------- --gpu-layers: blocks in CPU RAM
#: A dense model of 4 blocks of 20 MB, its own 10 MB embedding table (not tied to the head).
DENSE = ModelConfig(vocab_size=384, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=192,
                    max_seq_len=4096)


def dense_footprint(device: torch.device = GPU, embed: int = 10 * MB) -> Footprint:
    return Footprint(DENSE, "int4", 100 * MB, torch.bfloat16, device, (), False, (20 * MB,) * 4, embed)


def dense_plan(available: int, device: torch.device = GPU, host: int = 10**12, embed: int = 10 * MB,
               gpu_layers: int | None = None):
    return plan_for(dense_footprint(device, embed), 1024, available=(available, "test"),
                    host_available=(host, "test"), layers=LayerChoice(gpu_layers))


def test_a_dense_model_that_fits_stays_whole_and_one_that_does_not_keeps_its_first_blocks_in_ram() -> None:
    from localllm.runtime.kv_pool import sequence_bytes

    whole = dense_plan(10**12)
    assert whole.fits and whole.host_kv == whole.host_weights == 0 and whole.placement.cpu_layers == ()
    assert whole.placement.describe() == ["all layers on cuda"] and whole.n_gpu_layers is None
    everything = whole.total
    kv_block = sequence_bytes(DENSE, 1024, torch.bfloat16, batch=1, layers=[0])  # one block's KV cache
    # short by 1 byte: block 0 and the embedding table go to CPU RAM (30 MB and block 0's KV cache)
    for short, cpu in [(1, (0,)), (30 * MB + kv_block, (0,)), (30 * MB + kv_block + 1, (0, 1)),
                       (70 * MB + 3 * kv_block, (0, 1, 2)), (90 * MB + 4 * kv_block, (0, 1, 2, 3))]:
        p = dense_plan(everything - short)
        assert p.placement.cpu_layers == cpu and p.fits, short
        assert p.placement.n_gpu_layers == 4 - len(cpu) == p.n_gpu_layers and p.placement.layers_by == "automatic"
        assert p.host_weights == 10 * MB + 20 * MB * len(cpu) and p.host_kv == kv_block * len(cpu)
        assert p.total == everything - p.host_weights - p.host_kv
        assert p.host_total == p.host_weights + p.host_kv + RUNTIME_BYTES["cpu"]
    # not even the head alone: every block in CPU RAM, and it does not fit
    p = dense_plan(everything - 90 * MB - 4 * kv_block - 1)
    assert p.placement.cpu_layers == (0, 1, 2, 3) and not p.fits
    # a table tied to the head stays with it on the GPU: only the blocks move
    tied = dense_plan(everything - 20 * MB, embed=0)
    assert tied.placement.cpu_layers == (0,) and not tied.placement.embed_on_host and tied.host_weights == 20 * MB
    # the CPU's RAM must hold the blocks and their KV cache beside the process
    need = 30 * MB + kv_block + RUNTIME_BYTES["cpu"]
    assert dense_plan(everything - 1, host=need).fits and not dense_plan(everything - 1, host=need - 1).fits


def test_gpu_layers_places_the_last_n_blocks_on_the_gpu() -> None:
    p = dense_plan(10**12, gpu_layers=1)
    assert p.placement.cpu_layers == (0, 1, 2) and p.placement.layers_by == "--gpu-layers 1" and p.fits
    assert p.placement.host_modules() == {"layers.0", "layers.1", "layers.2", "embed"}
    assert dense_plan(10**12, gpu_layers=0).placement.cpu_layers == (0, 1, 2, 3)
    for n in (4, 99):  # all of them, or more than the model has: every block on the GPU
        p = dense_plan(10**12, gpu_layers=n)
        assert p.placement.cpu_layers == () and not p.placement.split and p.host_weights == 0 and p.n_gpu_layers is None
    for n in (None, 1, 99):  # a CPU run: accepted, no effect
        p = dense_plan(10**12, device=CPU, gpu_layers=n)
        assert p.placement is None and p.host_weights == p.host_kv == 0


def test_a_moe_model_moves_its_experts_first_then_its_blocks() -> None:
    """Automatic: every expert in CPU RAM before any block; a CPU block's experts are in RAM with it."""
    fp = Footprint(CONFIG, "int4", 80 * MB, torch.bfloat16, GPU, EXPERTS, False, (12 * MB,) * 6, 0)
    everything = plan_for(fp, 1024, available=LOTS, host_available=LOTS).total
    experts_only = plan_for(fp, 1024, available=(everything - 50 * MB, "t"), host_available=LOTS)
    assert experts_only.placement.host_layers == (0, 1, 3, 4, 5) and experts_only.placement.cpu_layers == ()
    p = plan_for(fp, 1024, available=(everything - 51 * MB, "t"), host_available=LOTS)
    assert p.fits and p.placement.cpu_layers == (0,) and p.placement.host_layers == (0, 1, 3, 4, 5)
    # block 0 (12 MB, its experts in it) + the other layers' experts
    assert p.host_weights == 12 * MB + 40 * MB
    p = plan_for(fp, 1024, available=LOTS, host_available=LOTS, layers=LayerChoice(4),
                 experts=ExpertChoice(n_cpu_moe=0))
    assert p.placement.cpu_layers == (0, 1) and p.placement.host_layers == (0, 1)
    assert p.placement.host_modules() == {"layers.0", "layers.1"}


def test_where_each_block_lives_is_said_with_the_reason() -> None:
    everything = dense_plan(10**12).total
    lines = dense_plan(everything - 1).placement.describe()
    assert lines[0] == "blocks 1-3, final norm, head and the KV cache of those blocks on cuda"
    assert lines[1].startswith("block 0 and embeddings and their KV cache in CPU RAM, run on the CPU (30 MB; "
                               "automatic; cuda memory: ")
    assert lines[1].endswith("free, 20 MB a block)")
    assert dense_plan(10**12, gpu_layers=1).placement.describe()[0] == \
        "block 3, final norm, head and the KV cache of those blocks on cuda"
    assert dense_plan(10**12, gpu_layers=4).placement.describe() == ["all layers on cuda"]


def test_a_gpu_layers_count_that_does_not_fit_is_refused_with_the_count_that_does() -> None:
    everything = dense_plan(10**12).total
    short = dense_plan(everything - 35 * MB, gpu_layers=3)  # block 0 alone is not enough
    assert not short.fits
    assert cheapest_fix(None, short, dense_footprint(), None) == "use --gpu-layers 2, or free memory"
    message = refusal("llama", short)
    assert message.startswith("llama needs ")
    assert "block 0 30 MB (embedding table 10 MB of it) + their KV cache" in message
    # every block in CPU RAM and still short: the head, KV cache and activations need a shorter context
    kv_blocks = dense_plan(10**12, gpu_layers=0).host_kv
    tight = dense_plan(everything - 90 * MB - kv_blocks - 1, gpu_layers=0)
    assert not tight.fits
    assert cheapest_fix(None, tight, dense_footprint(), None).startswith("use --ctx ")
    # the CPU's RAM too small for the blocks: said beside the GPU's numbers
    ram = dense_plan(everything - 1, host=MB)
    assert not ram.fits and "; in CPU RAM " in refusal("m", ram)


def test_run_and_show_take_gpu_layers_and_a_cpu_run_ignores_it(moe_folder) -> None:
    from click.testing import CliRunner

    from localllm.cli import main

    result = CliRunner().invoke(main, ["run", str(moe_folder), "hello", "--raw", "-n", "2", "--no-compile",
                                       "--temperature", "0", "--device", "cpu", "--verbose", "--gpu-layers", "1"])
    assert result.exit_code == 0, result.output
    assert "placement:" not in result.output and "eval count" in result.output
    result = CliRunner().invoke(main, ["run", str(moe_folder), "hello", "--gpu-layers", "-1"])
    assert result.exit_code != 0 and "-1" in result.output


def test_a_gpu_run_places_a_real_models_blocks_by_its_sizes(moe_folder, monkeypatch) -> None:
    """``check_memory`` on a GPU target (the plan builds on ``meta``): with room for all but half of
    block 0, the automatic plan (every expert in CPU RAM first) keeps block 0 in CPU RAM."""
    from localllm.loaders.memory_plan import check_memory, footprint
    from localllm.loaders.load import open_checkpoint
    from localllm.loaders.spec import LoadSpec
    from localllm.quant.target import Target

    gpu = Target(GPU, (8, 9))
    spec = LoadSpec(str(moe_folder), device=gpu, quant="int4")
    fp = footprint(open_checkpoint(str(moe_folder)), spec)
    assert len(fp.layer_bytes) == 3 and fp.layer_bytes[0] > fp.expert_bytes[0] > 0 and fp.embed_bytes > 0
    experts = plan_for(fp, 256, available=LOTS, host_available=LOTS, experts=ExpertChoice(cpu_moe=True))
    room = experts.total - (fp.layer_bytes[0] - fp.expert_bytes[0]) // 2
    monkeypatch.setattr("localllm.loaders.memory_plan.available_memory",
                        lambda device: (room, "test") if device.type == "cuda" else (10**12, "test"))
    plan = check_memory(spec, 256)
    assert plan.fits and plan.placement.cpu_layers == (0,) and plan.placement.host_layers == (0, 2)


#: A Gemma-3-like model: five sliding layers to one full-context one, so its pool has layer groups
#: whose slots span the --gpu-layers boundary.
GROUPED = ModelConfig(vocab_size=384, dim=64, n_layers=12, n_heads=4, n_kv_heads=2, head_dim=16,
                      intermediate_size=192, max_seq_len=4096, sliding_window=64,
                      layer_types=(["sliding"] * 5 + ["full"]) * 2)


@pytest.mark.parametrize("config", [DENSE, GROUPED], ids=["dense", "grouped"])
def test_a_split_plans_kv_cache_is_what_the_pool_allocates_on_each_device(config: ModelConfig) -> None:
    """The plan's CPU and GPU shares of the KV cache equal the bytes KVPool.allocate puts on each device
    for the engine run makes (tensors on meta: nothing is allocated); a grouped pool's slots shared
    across the boundary keep a full tensor on each device, which the plan counts."""
    from localllm.runtime.kv_pool import KVPool, plan_pool, sequence_chunk, sequence_pool_bytes

    n, ctx, act = config.n_layers, 1024, torch.bfloat16
    fp = Footprint(config, "int4", 100 * MB, act, GPU, (), False, (20 * MB,) * n, 10 * MB)
    p = plan_for(fp, ctx, available=(10**12, "test"), host_available=(10**12, "test"), layers=LayerChoice(n // 2))
    assert p.placement.cpu_layers == tuple(range(n // 2))
    pool_plan = plan_pool(config, sequence_pool_bytes(config, act, ctx, chunk_tokens=sequence_chunk(config, ctx)), act)
    meta = torch.device("meta")  # the GPU's stand-in: shapes and bytes, nothing allocated
    pool = KVPool.allocate(config, pool_plan, [CPU] * (n // 2) + [meta] * (n - n // 2))
    tensors = {id(t): t for t in pool.k + pool.v}.values()  # allocate's distinct tensors
    on = {d: sum(t.numel() * t.element_size() for t in tensors if t.device == d) for d in (CPU, meta)}
    on[torch.device("cuda:0")] = on[meta]
    rope = p.kv_cache - p.host_kv - on[torch.device("cuda:0")]
    assert p.host_kv == on[CPU] > 0
    assert rope == 2 * ctx * config.rotary_dim * act.itemsize * (2 if config.rope_local_theta else 1)
    whole = plan_for(fp, ctx, available=(10**12, "test"))
    if config is DENSE:  # one group: the split shares the pool out by layer
        assert p.kv_cache == whole.kv_cache and p.host_kv == whole.kv_cache - rope - on[torch.device("cuda:0")]
    else:  # every slot has layers on both sides: a full pool on each device
        assert on[CPU] == on[meta] == pool_plan.bytes


def test_layer_devices_are_read_once_placed_and_again_after_a_move() -> None:
    """forward_paged asks every step: the blocks' devices are kept once off meta, forgotten by .to()."""
    from localllm.runtime.model import Transformer

    with torch.device("meta"):
        model = Transformer(DENSE)
    assert model.layer_devices() == (torch.device("meta"),) * 4 and model._layer_devices is None  # not placed yet
    model.to_empty(device=CPU)
    first = model.layer_devices()
    assert first == (CPU,) * 4 and model.layer_devices() is first
    model.to(torch.float16)
    assert model._layer_devices is None and model.layer_devices() == first


def test_every_weight_count_follows_one_rule() -> None:
    """A block's, the embedding table's and the whole model's bytes add up (untied: the model is its
    blocks, table, norm and head), and none counts a RoPE table or a KV cache buffer."""
    from localllm.loaders.memory_plan import meta_weight_bytes
    from localllm.loaders.placement import layer_bytes, own_embed_bytes, weight_bytes
    from localllm.runtime.model import Transformer

    act = torch.bfloat16
    with torch.device("meta"):
        model = Transformer(DENSE)
        model.layers[0].attn.register_buffer("rope_cos", torch.empty(1000, 16))  # neither is a weight
        model.layers[1].register_module("kv_cache", torch.nn.Module())
        model.layers[1].kv_cache.register_buffer("k", torch.empty(1000, 64))
    blocks_ = layer_bytes(model, act)
    assert blocks_[0] == blocks_[1] == blocks_[3] == weight_bytes(model.layers[2], act) > 0
    embed = own_embed_bytes(model, act)
    assert embed == DENSE.vocab_size * DENSE.dim * act.itemsize
    rest = weight_bytes(model.norm, act) + weight_bytes(model.output, act)
    assert meta_weight_bytes(model, act) == sum(blocks_) + embed + rest


# --------------------------------------------------------------------------- serve and bench take the flags
class Loaded(Exception):
    """Raised by a stubbed ``create_app`` once it has serve's ServerConfig: the command stops there."""


@pytest.fixture
def captured_specs(monkeypatch) -> list:
    """``load_model`` stubbed: it records each LoadSpec it is given and stops the command."""
    from localllm.errors import LocalLLMError
    from localllm.loaders import load

    specs: list = []

    def stub(spec, **_):  # type: ignore[no-untyped-def]
        specs.append(spec)
        raise LocalLLMError("stubbed load", "none: a test")

    monkeypatch.setattr(load, "load_model", stub)
    return specs


#: Flags, and the (cpu_moe, n_cpu_moe, gpu_layers) of the LoadSpec they give.
PLACEMENT_CASES = [([], (False, None, None)), (["--cpu-moe"], (True, None, None)),
                   (["--n-cpu-moe", "2", "--gpu-layers", "3"], (False, 2, 3)),
                   (["--gpu-layers", "0"], (False, None, 0))]


def _placement_of(spec) -> tuple:  # type: ignore[no-untyped-def]
    return spec.cpu_moe, spec.n_cpu_moe, spec.gpu_layers


@pytest.mark.parametrize("flags,want", PLACEMENT_CASES)
def test_serve_passes_the_flags_to_every_model_it_loads(flags, want, moe_folder, captured_specs, monkeypatch) -> None:
    """``serve``'s flags reach its ServerConfig, whose load spec every model the server loads is loaded
    by: a preloaded one and one a request names alike (both load through ``_load_blocking``)."""
    from click.testing import CliRunner

    from localllm.cli import main
    from localllm.server import app
    from localllm.server.metrics import Metrics
    from localllm.server.models import ModelManager
    from localllm.server.names import operator_target

    configs = []

    def create_app(config):  # type: ignore[no-untyped-def]
        configs.append(config)
        raise Loaded

    monkeypatch.setattr(app, "create_app", create_app)
    result = CliRunner().invoke(main, ["serve", "--port", "0", "--device", "cpu", *flags])
    assert isinstance(result.exception, Loaded), result.output
    config = configs[0]
    assert _placement_of(config.load_spec("m")) == want and config.load_spec("m").device == "cpu"
    name = str(moe_folder)
    with pytest.raises(Exception, match="stubbed load"):
        ModelManager(config, Metrics())._load_blocking(name, operator_target(name))
    assert captured_specs[0].ref == name and _placement_of(captured_specs[0]) == want


@pytest.mark.parametrize("flags,want", PLACEMENT_CASES)
def test_bench_passes_the_flags_to_each_scheme_and_the_serving_mode(flags, want, moe_folder, captured_specs,
                                                                    monkeypatch) -> None:
    from click.testing import CliRunner

    from localllm.bench import measure
    from localllm.cli import main

    monkeypatch.setattr(measure, "run_bench", lambda load, *args, **kw: load("int4"))  # straight to the load
    for mode in (["--quant", "int4"], ["--concurrency", "1"]):
        result = CliRunner().invoke(main, ["bench", str(moe_folder), "--device", "cpu", *mode, *flags])
        assert result.exit_code == 1 and "stubbed load" in result.output, result.output
    assert len(captured_specs) == 2
    for spec in captured_specs:
        assert spec.ref == str(moe_folder) and _placement_of(spec) == want


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_serve_and_bench_refuse_a_negative_count_as_run_does(command: str) -> None:
    from click.testing import CliRunner

    from localllm.cli import main

    for flag in ("--n-cpu-moe", "--gpu-layers"):
        result = CliRunner().invoke(main, [command, flag, "-1"])
        assert result.exit_code == 2, result.output
        assert f"Invalid value for '{flag}': -1 is not in the range x>=0" in result.output


def test_bench_reports_where_the_parts_live_as_run_verbose_does(tiny_fp32, monkeypatch) -> None:
    """A scheme's column and the serving mode's result name the placement with ``run --verbose``'s lines
    (:func:`localllm.report.placement_lines`), on stderr and in the JSON; nothing on a CPU run. The
    placement is set by hand (a CPU machine places nothing): the report, not the plan, is checked."""
    from types import SimpleNamespace

    from localllm.bench import serving
    from localllm.bench.runs import measure_scheme
    from localllm.bench.serving import ServingSettings, bench_serving
    from localllm.bench.settings import Settings
    from localllm.loaders import load
    from localllm.report import MOE_GRAPHS_NOTE, placement_lines

    n = tiny_fp32.config.n_layers
    where = Placement("cuda:0", (0,) * n, 0, "automatic", 0, 1, (10 * MB,) * n, 5 * MB, "--gpu-layers 1")
    s = Settings(["fp32"], CPU, prompt_tokens=8, gen_tokens=2, runs=1, quality=False)
    for placement in (None, where):
        monkeypatch.setattr(tiny_fp32, "placement", placement)
        log: list[str] = []
        figures, _ = measure_scheme(lambda name: tiny_fp32, "fp32", list(range(1, 9)), s, log.append)
        lines = placement_lines(tiny_fp32)
        assert lines == ([] if placement is None else where.describe())
        assert figures["placement"] == (lines or None)
        assert [line for line in log if "placement:" in line] == [f"  fp32: placement: {line}" for line in lines]
    assert where.describe()[1].startswith("block 0 and embeddings and their KV cache in CPU RAM")
    assert where.describe()[1].endswith("; --gpu-layers 1)")
    # a MoE model on a GPU: the same lines and the CUDA graphs' note, in the serving mode's JSON too
    moe = SimpleNamespace(placement=where, config=SimpleNamespace(is_moe=True), source="m", scheme_label="int4",
                          kernels={}, model=None, tokenizer=SimpleNamespace(encode=lambda text: [1, 2, 3]))
    monkeypatch.setattr(load, "load_model", lambda spec: moe)
    monkeypatch.setattr(serving, "run_serving", lambda *args: {"concurrency": [], "comparison": {}})
    log = []
    data = bench_serving("m", ServingSettings("uniform", [1]), device="cpu", log=log.append)
    assert data["placement"] == [*where.describe(), MOE_GRAPHS_NOTE]
    assert [line for line in log if line.startswith("placement:")] == [f"placement: {x}" for x in data["placement"]]
