"""What the TransformerEngine / FP8 path takes from the installed megatron-core, pinned on CPU.

The TE path runs only where CUDA and TransformerEngine are, so its calls into megatron-core are checked
here against the installed source: the TE layer spec's keywords, the ``TransformerConfig`` FP8 fields
and recipe names, the FP8 alignment, the TE wrappers' constructor and forward (read with ``ast`` from
``megatron/core/extensions/transformer_engine.py``, which cannot be imported usefully without TE), the
recipe classes megatron-core hands TE (which FP8 checkpoint metadata pickles), and the torch APIs the
GPU code calls. Nothing here imports ``transformer_engine``.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_logra.models import te


def _source(module: str) -> str:
    return Path(importlib.util.find_spec(module).origin).read_text()


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    found += [n for top in tree.body if isinstance(top, ast.If) for n in ast.walk(top)
              if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"megatron-core has no class {name}"
    return found[0]


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _super_init_keywords(cls: ast.ClassDef) -> dict[str, str]:
    """Keyword -> source text of the ``super().__init__(...)`` call in ``cls.__init__``."""
    init = _method(cls, "__init__")
    for node in ast.walk(init):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__init__"
                and isinstance(node.func.value, ast.Call) and getattr(node.func.value.func, "id", "") == "super"):
            return {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg}
    raise AssertionError(f"{cls.name}.__init__ calls no super().__init__")


@pytest.fixture(scope="module")
def te_ext() -> ast.Module:
    return ast.parse(_source("megatron.core.extensions.transformer_engine"))


# ---------------------------------------------------------------- layer spec and its availability check

def test_te_layer_spec_takes_the_keyword_we_pass():
    from megatron.core.models.gpt import gpt_layer_specs

    params = inspect.signature(gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec).parameters
    assert "qk_layernorm" in params
    assert hasattr(gpt_layer_specs, "HAVE_TE")


def test_te_spec_is_refused_when_megatrons_te_wrappers_did_not_load(monkeypatch):
    """megatron-core sets two flags: ``gpt_layer_specs.HAVE_TE`` once ``import transformer_engine`` works, and
    ``extensions.transformer_engine.HAVE_TE`` once its wrappers' own TE imports work. With only the first, the
    spec builds from mocks and the first layer says TE "is not installed"; ``layer_spec`` says what failed."""
    from megatron.core.extensions import transformer_engine as mcore_te
    from megatron.core.models.gpt import gpt_layer_specs

    monkeypatch.setattr(gpt_layer_specs, "HAVE_TE", True)
    monkeypatch.setattr(mcore_te, "HAVE_TE", False)
    problem = te.te_import_problem()
    assert problem and "megatron-core 0." in problem and "transformer_engine" in problem.lower()
    with pytest.raises(RuntimeError, match=r"model\.transformer_impl='transformer_engine': megatron-core .*cannot "
                                           r"use TransformerEngine") as info:
        te.layer_spec("transformer_engine", normalization="RMSNorm", qk_layernorm=False)
    if not te.te_installed():  # the import that failed is named
        assert "ModuleNotFoundError" in str(info.value)
    monkeypatch.setattr(gpt_layer_specs, "HAVE_TE", False)
    assert te.te_import_problem()
    monkeypatch.setattr(gpt_layer_specs, "HAVE_TE", True)
    monkeypatch.setattr(mcore_te, "HAVE_TE", True)
    assert te.te_import_problem() is None


def test_the_te_wrappers_import_what_the_availability_check_reports(te_ext):
    """``te_import_problem`` retries the import megatron-core's wrappers make; it must stay the same one."""
    imports = {(n.module, tuple(a.name for a in n.names)) for n in ast.walk(te_ext)
               if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("transformer_engine")}
    assert te.MCORE_TE_IMPORT in imports, imports


# ---------------------------------------------------------------- FP8 configuration

@pytest.mark.parametrize("fmt", te.FP8_FORMATS)
@pytest.mark.parametrize("recipe", te.FP8_RECIPES)
def test_transformer_config_takes_the_fp8_fields(fmt, recipe):
    from megatron.core.enums import Fp8Recipe
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = te.fp8_config_kwargs(fmt, recipe, "transformer_engine")
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **kwargs)
    assert cfg.fp8 == fmt and cfg.fp8_recipe == Fp8Recipe(recipe)
    assert cfg.fp8_wgrad is True and cfg.disable_parameter_transpose_cache is True
    assert cfg.fp8_param is False  # weights stay 16-bit: LoGRA merges into them in place


def test_recipes_and_token_alignment_match_megatron():
    from megatron.core.enums import Fp8Recipe
    from megatron.core.fp8_utils import get_fp8_align_size

    assert set(te.FP8_RECIPES) <= {r.value for r in Fp8Recipe}
    for recipe in te.FP8_RECIPES:
        assert te.fp8_token_multiple(recipe) == get_fp8_align_size(Fp8Recipe(recipe)), recipe


def test_model_config_keeps_gradient_accumulation_fusion_off():
    """TE's wrappers pass ``fuse_wgrad_accumulation=config.gradient_accumulation_fusion``; fused, TE would
    write trained weights' gradients into ``main_grad``, which the native AdamW owns (it folds ``.grad``
    into it), and expect megatron's DDP buffers there."""
    from megatron_logra.models.gpt import ModelConfig, _transformer_config

    groups = SimpleNamespace(tp_size=1, pp_size=1)
    assert _transformer_config(ModelConfig(vocab_size=64, seq_length=16), groups, None).gradient_accumulation_fusion \
        is False


def test_megatrons_fp8_recipes_are_the_ones_checkpoint_metadata_may_hold():
    """megatron-core passes TE these recipe objects; TE pickles the recipe into each layer's ``_extra_state``
    and the checkpoint check (``checkpoint.dcp_metadata.RECIPE_GLOBALS``) must accept every one of them."""
    from megatron_logra.checkpoint.dcp_metadata import RECIPE_GLOBALS

    src = _source("megatron.core.fp8_utils")
    used = set(re.findall(r"transformer_engine\.common\.recipe\.(\w+)", src))
    assert {"Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "Format"} <= used, used
    allowed = {name for _, name in RECIPE_GLOBALS}
    assert used <= allowed, used - allowed
    assert "TEDelayedScaling(" in src
    assert ("megatron.core.extensions.transformer_engine", "TEDelayedScaling") in RECIPE_GLOBALS


# ---------------------------------------------------------------- the TE wrappers the sketch hooks sit on

def test_layernorm_column_linear_normalises_inside_and_returns_no_norm_output(te_ext):
    """A forward hook on ``TELayerNormColumnParallelLinear`` sees the *pre-norm* hidden state; the sketch
    recomputes ``norm(x)`` from the attributes TE's ``LayerNormLinear`` stores from these keywords
    (``eps``, ``normalization``, ``zero_centered_gamma``; ``layer_norm_weight`` / ``layer_norm_bias``)."""
    cls = _class(te_ext, "TELayerNormColumnParallelLinear")
    assert [b.attr for b in cls.bases if isinstance(b, ast.Attribute)] == ["LayerNormLinear"]
    kw = _super_init_keywords(cls)
    assert kw["return_layernorm_output"] == "False"
    assert kw["eps"] == "self.config.layernorm_epsilon"
    assert kw["zero_centered_gamma"] == "self.config.layernorm_zero_centered_gamma"
    assert kw["parallel_mode"] == "'column'"
    assert kw["fuse_wgrad_accumulation"] == "self.config.gradient_accumulation_fusion"
    assert "extra_kwargs['normalization'] = self.config.normalization" in ast.unparse(_method(cls, "__init__"))


@pytest.mark.parametrize("name", ["TELinear", "TELayerNormColumnParallelLinear"])
def test_wrapper_forward_takes_the_input_alone_and_returns_output_and_bias(te_ext, name):
    cls = _class(te_ext, name)
    forward = _method(cls, "forward")
    assert [a.arg for a in forward.args.args] == ["self", "x"]  # the hook reads args[0]
    body = ast.unparse(forward)
    assert "return (out, None)" in body  # a tuple: the hook wraps output[0]
    assert "self.disable_parameter_transpose_cache" in body  # FP8 weights recast every forward when set
    assert "self.disable_parameter_transpose_cache = self.config.disable_parameter_transpose_cache" in ast.unparse(
        _method(cls, "__init__"))


def test_te_linear_passes_the_attributes_classification_reads(te_ext):
    """``sketch.layers._classify_te`` reads ``parallel_mode`` (None for duplicated) and ``sequence_parallel``,
    which TE's ``Linear`` stores from these keywords."""
    kw = _super_init_keywords(_class(te_ext, "TELinear"))
    assert kw["parallel_mode"] == "te_parallel_mode"
    assert kw["sequence_parallel"] == "self.config.sequence_parallel"
    assert kw["fuse_wgrad_accumulation"] == "self.config.gradient_accumulation_fusion"
    assert "te_parallel_mode = None" in ast.unparse(_method(_class(te_ext, "TELinear"), "__init__"))
    for name, mode in (("TEColumnParallelLinear", "'column'"), ("TERowParallelLinear", "'row'")):
        assert _super_init_keywords(_class(te_ext, name))["parallel_mode"] == mode


# ---------------------------------------------------------------- torch APIs of the GPU code

def test_cuda_graph_context_takes_stream_and_capture_error_mode():
    params = inspect.signature(torch.cuda.graph.__init__).parameters
    assert {"cuda_graph", "pool", "stream", "capture_error_mode"} <= set(params)
    assert hasattr(torch.cuda, "CUDAGraph")


def test_distributed_apis_of_the_nccl_path():
    assert issubclass(dist.DistError, Exception)
    assert "use_local_synchronization" in inspect.signature(dist.new_group).parameters
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        assert callable(getattr(dist, name))


# ---------------------------------------------------------------- FP8 weight shapes (TE's assert_dim_for_fp8_exec)

def _model(**kw):
    from megatron_logra.models.gpt import ModelConfig

    base = dict(num_layers=2, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256, vocab_size=256,
                seq_length=64, transformer_impl="auto", fp8="hybrid")
    base.update(kw)
    return ModelConfig(**base)


def test_fp8_weight_shapes_follow_te_per_rank():
    assert te.fp8_weight_shape_problems(_model(fp8=None, hidden_size=72, num_attention_heads=3, ffn_hidden_size=200),
                                        1) == []
    assert te.fp8_weight_shape_problems(_model(), 1) == []
    assert te.fp8_weight_shape_problems(_model(), 4) == []  # qkv [96, 128], proj [128, 32], fc1 [128, 128], fc2 [128, 64]
    # ffn 200: fc2's 200 input columns are no multiple of 16, fc1's 400 rows are one of 8
    assert te.fp8_weight_shape_problems(_model(ffn_hidden_size=200), 1) == ["linear_fc2 [128, 200] per rank"]
    # at TP 8: qkv's shard has 48 rows and proj's 16 input columns, fine for the per-tensor recipes, not for
    # mxfp8's blocks of 32 on both sides
    assert te.fp8_weight_shape_problems(_model(), 8) == []
    assert te.fp8_weight_shape_problems(_model(fp8_recipe="mxfp8"), 8) == [
        "linear_qkv [48, 128] per rank", "linear_proj [128, 16] per rank"]
    assert te.fp8_weight_shape_problems(_model(fp8_recipe="mxfp8"), 4) == []
    assert te.fp8_weight_shape_problems(_model(ffn_hidden_size=272), 1) == []
    assert te.fp8_weight_shape_problems(_model(ffn_hidden_size=272, fp8_recipe="mxfp8"), 1) == [
        "linear_fc2 [128, 272] per rank"]


def test_run_config_refuses_fp8_weight_shapes_naming_the_fields():
    from megatron_logra.config import RunConfig
    from megatron_logra.parallel import ParallelConfig

    with pytest.raises(ValueError, match=r"model\.fp8=hybrid .*parallel\.tp=1: TransformerEngine's FP8 GEMMs .*"
                                         r"linear_fc2 \[128, 200\] per rank .*model\.fp8=null"):
        RunConfig(job="rl", model=_model(ffn_hidden_size=200))
    RunConfig(job="rl", model=_model(), parallel=ParallelConfig(tp=2))


FP8_RECIPE_NAMES = ("delayed", "tensorwise", "blockwise", "mxfp8")


@pytest.mark.parametrize("capability,runs", [
    ((8, 0), set()),                                     # A100: no FP8 GEMMs
    ((8, 9), {"delayed", "tensorwise"}),                 # L40S / Ada
    ((9, 0), {"delayed", "tensorwise", "blockwise"}),    # H100
    ((10, 0), set(FP8_RECIPE_NAMES)),                    # B200
])
def test_fp8_recipes_are_refused_on_gpus_that_cannot_run_them(capability, runs):
    """TransformerEngine's own checks: FP8 needs 8.9 (check_fp8_support), block scaling 9.0
    (check_fp8_block_scaling_support), MXFP8 10.0 (check_mxfp8_support)."""
    for recipe in FP8_RECIPE_NAMES:
        problem = te.fp8_device_problem(recipe, capability)
        if recipe in runs:
            assert problem is None, (recipe, capability)
        else:
            assert f"model.fp8_recipe={recipe}" in problem and f"{capability[0]}.{capability[1]}" in problem
            assert ("model.fp8=null" in problem) if not runs else all(r in problem for r in runs), problem


# TransformerEngine's own answers, as ``FP8GlobalStateManager.is_*_available()`` returns them
# (``transformer_engine/pytorch/quantization.py``, TE 2.x: ``_compute_mxfp8_support`` refuses 12.0+,
# ``_compute_fp8_block_scaling_support`` needs CUDA >= 12.9 besides 9.0).
_TE_ON_SM120 = {"delayed": (True, ""), "tensorwise": (True, ""), "blockwise": (True, ""),
                "mxfp8": (False, "MXFP8 (for all gemm layouts) is not supported on 12.0+ architectures yet.")}
_TE_ON_H100_CUDA_12_8 = {"delayed": (True, ""), "tensorwise": (True, ""), "mxfp8": (
    False, "Device compute capability 10.0 or higher required for MXFP8 execution."), "blockwise": (
    False, "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9.")}


@pytest.mark.parametrize("capability,verdicts,refused,runs", [
    ((12, 0), _TE_ON_SM120, "mxfp8", {"delayed", "tensorwise", "blockwise"}),
    ((9, 0), _TE_ON_H100_CUDA_12_8, "blockwise", {"delayed", "tensorwise"}),
])
def test_fp8_recipes_follow_transformer_engines_own_verdict(capability, verdicts, refused, runs):
    """Where the installed TE says, its verdict decides, also against the capability table (which lets MXFP8
    through on 12.0 and block scaling on any Hopper): the refusal quotes TE's reason and names what runs."""
    problem = te.fp8_device_problem(refused, capability, verdicts)
    assert problem is not None and f"model.fp8_recipe={refused}" in problem and verdicts[refused][1] in problem
    assert all(r in problem for r in runs), problem
    for recipe in runs:
        assert te.fp8_device_problem(recipe, capability, verdicts) is None
    assert te.fp8_device_problem(refused, capability, {}) is None  # the table alone would have let it through
