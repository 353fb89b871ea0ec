"""The real TransformerEngine modules behind the sketch hooks and the FP8 checkpoint check (GPU + TE).

* A forward hook on megatron's ``TELayerNormColumnParallelLinear`` sees the *pre-norm* hidden state, and
  ``sketch.layers.normalized_input`` reproduces the norm TE applies inside the module (RMSNorm,
  LayerNorm, zero-centred γ): with an identity weight the module's output *is* its normalised input.
* The FP8 metadata TE keeps in a layer's ``_extra_state`` after an FP8 forward under the recipe megatron
  builds (``fp8_utils.get_fp8_context``) passes ``checkpoint.dcp_metadata.check_extra_state``: the
  recipe classes TE pickles are the ones ``RECIPE_GLOBALS`` allows.

Skipped without CUDA or without transformer_engine (the FP8 part also below compute capability 8.9).
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.models.te import te_installed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not te_installed(), reason="needs CUDA and transformer_engine"),
]

H = 128


@pytest.fixture
def groups():
    from megatron_logra.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    g = initialize_parallel(ParallelConfig(), seed=1)
    try:
        yield g
    finally:
        destroy_parallel()


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=1, hidden_size=H, num_attention_heads=4, params_dtype=torch.float32,
                gradient_accumulation_fusion=False)
    base.update(kw)
    return TransformerConfig(**base)


@pytest.mark.parametrize("normalization,zero_centered", [("RMSNorm", False), ("RMSNorm", True), ("LayerNorm", False)])
def test_hook_sees_the_pre_norm_input_and_normalized_input_matches_te(groups, normalization, zero_centered):
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear

    from megatron_logra.sketch.layers import classify_linear, normalized_input

    cfg = _config(normalization=normalization, layernorm_zero_centered_gamma=zero_centered, layernorm_epsilon=1e-5)
    m = TELayerNormColumnParallelLinear(H, H, config=cfg, init_method=torch.nn.init.zeros_, gather_output=False,
                                        bias=False, skip_bias_add=False, is_expert=False, tp_group=groups.tp).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        m.weight.copy_(torch.eye(H, device="cuda"))
        m.layer_norm_weight.copy_(torch.rand(H, generator=gen, device="cuda") + 0.5)
        if m.layer_norm_bias is not None:
            m.layer_norm_bias.copy_(torch.randn(H, generator=gen, device="cuda") * 0.1)
    info = classify_linear(m, groups.tp, "linear_qkv")
    assert info.fused_norm and info.backend == "transformer_engine" and info.parallel == "column"
    assert (m.normalization, m.eps, m.zero_centered_gamma) == (normalization, 1e-5, zero_centered)

    seen = []
    m.register_forward_hook(lambda mod, args, out: seen.append((args, out)))
    x = torch.randn(8, 2, H, generator=gen, device="cuda") * 3 + 1
    out, bias = m(x)
    assert bias is None
    (args, hooked_out), = seen
    assert args[0] is x  # the hook sees the module's input: the pre-norm hidden state
    assert isinstance(hooked_out, tuple) and hooked_out[0] is out
    ours = normalized_input(m, x)
    rel = float((ours.double() - out.double()).abs().max() / out.double().abs().max())
    assert rel < 5e-3, rel  # TE's fp32 GEMM may run in TF32
    assert float((x - out).abs().max()) > 0.1  # and that is not the raw input


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_extra_state_passes_the_checkpoint_check(groups, recipe):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability >= 8.9")
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear
    from megatron.core.fp8_utils import get_fp8_context

    from megatron_logra.checkpoint.dcp_metadata import check_extra_state
    from megatron_logra.models.te import fp8_config_kwargs

    cfg = _config(params_dtype=torch.bfloat16, bf16=True, **fp8_config_kwargs("hybrid", recipe, "transformer_engine"))
    m = TEColumnParallelLinear(H, H, config=cfg, init_method=torch.nn.init.normal_, gather_output=False, bias=False,
                               skip_bias_add=False, is_expert=False, tp_group=groups.tp).cuda()
    x = torch.randn(32, 2, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    try:
        context = get_fp8_context(cfg)
    except (ValueError, AssertionError) as exc:  # a recipe this TE release does not have
        pytest.skip(f"fp8_recipe={recipe}: {exc}")
    with context:
        out, _ = m(x)
    out.float().sum().backward()
    state = m.get_extra_state()
    assert isinstance(state, torch.Tensor) and state.dtype == torch.uint8
    check_extra_state([state.cpu()], f"TE {recipe} extra state")  # raises CheckpointError for a refused global


def test_fp8_recipe_refusals_follow_the_installed_transformer_engine():
    """TransformerEngine answers for every recipe on this GPU (``FP8GlobalStateManager.is_*_available``), and a
    model built with a recipe it refuses is refused before any GEMM, with TE's reason."""
    from megatron_logra.models.fp8 import FP8_RECIPES, fp8_config_kwargs, fp8_device_problem, te_recipe_verdicts

    verdicts = te_recipe_verdicts()
    assert set(verdicts) == set(FP8_RECIPES), verdicts
    capability = torch.cuda.get_device_capability()
    for recipe, (ok, reason) in verdicts.items():
        assert (fp8_device_problem(recipe, capability, verdicts) is None) == ok, (recipe, reason)
        if not ok:
            with pytest.raises(ValueError, match=f"model.fp8_recipe={recipe}"):
                fp8_config_kwargs("hybrid", recipe, "transformer_engine")
