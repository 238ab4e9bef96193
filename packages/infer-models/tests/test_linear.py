"""Linear layers and their methods (infer.models.linear_method), each built with a kernel policy:
dense_linear against F.linear (the CPU split path for a few fp32 rows gives the same outputs, with
and without bias, and every other input goes to F.linear itself), and each method and fused
pre-norm projection against the kernel it should run."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from infer.kernels import (
    gated_gemv,
    gelu_tanh_and_mul,
    gemv,
    int8_cpu_scale,
    int8_linear_cpu,
    native_cpu_kernels_available,
    quantized_gated_gemv,
    silu_and_mul,
)
from infer.models.common import GatedMLP, RMSNorm
from infer.models.kernel_policy import KernelPolicy, apply_kernel_policy
from infer.models.linear import Linear
from infer.models.linear_method import CPU_SPLIT, CPU_SPLIT_MAX_ROWS, dense_linear, launches_pdl
from infer.models.prenorm import NormedGemvProjection, PreNormProjection
from infer.models.quantization import quantize_weight

PLAIN_CUDA = KernelPolicy("cuda")
TRITON_GEMV = KernelPolicy("cuda", use_triton_gemv=True)


@pytest.mark.parametrize("rows", range(1, CPU_SPLIT_MAX_ROWS + 1))
@pytest.mark.parametrize("shape", [(576, 3 * 576), (1536, 576), (49152 // 16, 576), (8, 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_cpu_split_path_equals_f_linear(rows, shape, bias):
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    out = dense_linear(x, weight, b)
    assert out.shape == (rows, out_features) and out.is_contiguous()
    # Against float64: fp32 sums in another order differ by ~1e-6 of their terms' size (~30 here).
    exact = F.linear(x.double(), weight.double(), b.double() if bias else None)
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(F.linear(x, weight, b).double(), exact, rtol=1e-5, atol=1e-4)


def test_other_inputs_go_to_f_linear_unchanged(monkeypatch):
    calls = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda *args: calls.append(args) or real(*args))
    weight = torch.randn(3 * CPU_SPLIT, 16)
    for x, w in [
        (torch.randn(CPU_SPLIT_MAX_ROWS + 1, 16), weight),  # a prompt chunk
        (torch.randn(1, 16, dtype=torch.bfloat16), weight.bfloat16()),  # not fp32
        (torch.randn(1, 16), torch.randn(CPU_SPLIT + 1, 16)),  # rows that do not split evenly
    ]:
        assert torch.equal(dense_linear(x, w), real(x, w))
    assert len(calls) == 3


def test_a_linear_layer_decodes_through_it():
    layer = Linear(16, 3 * CPU_SPLIT)
    torch.nn.init.normal_(layer.weight)
    x = torch.randn(1, 16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not native_cpu_kernels_available(), reason="infer.kernels' C kernels are not built here")
def test_an_int8_linear_on_a_cpu_runs_the_c_kernel_unless_its_policy_says_not_to():
    """A few rows run the AVX2 kernel under the default policy and ATen's under
    `use_native_cpu_kernels=False`; the two round x differently (int16 against bf16), which is
    what tells them apart."""
    layer = Linear(576, 64)
    weight, scale = quantize_weight(torch.randn(64, 576), "int8", (1, 576))
    layer.quantize(torch.int8, (1, 576))
    layer.weight.data, layer.weight_scale.data = weight, scale
    x = torch.randn(2, 576)
    avx2 = int8_linear_cpu(x, weight, int8_cpu_scale(scale))
    aten = int8_linear_cpu(x, weight, int8_cpu_scale(scale), native=False)
    assert not torch.equal(avx2, aten)
    apply_kernel_policy(layer, KernelPolicy("cpu", use_native_cpu_kernels=False))
    assert torch.equal(layer(x), aten)
    apply_kernel_policy(layer, KernelPolicy("cpu"))
    assert torch.equal(layer(x), avx2)


@pytest.mark.gpu
def test_with_the_triton_gemv_one_row_runs_the_triton_kernel_and_the_rest_cublas():
    """Built with `use_triton_gemv`, a dense Linear's one-row CUDA input gives infer.kernels.gemv's
    output bit for bit, and two rows, or one row built without it, give F.linear's. The two differ
    in the last bits at K = 8192 (sums in another order), which is what tells them apart."""
    gen = torch.Generator("cuda").manual_seed(0)
    layer = Linear(8192, 2048).to(device="cuda", dtype=torch.bfloat16)
    layer.weight.data = torch.randn(2048, 8192, generator=gen, device="cuda", dtype=torch.bfloat16) / 90
    one, two = (torch.randn(n, 8192, generator=gen, device="cuda", dtype=torch.bfloat16) for n in (1, 2))
    ours, cublas = gemv(one, layer.weight), F.linear(one, layer.weight)
    assert not torch.equal(ours, cublas)
    apply_kernel_policy(layer, TRITON_GEMV)
    assert torch.equal(layer(one), ours)
    assert torch.equal(layer(two), F.linear(two, layer.weight))
    apply_kernel_policy(layer, PLAIN_CUDA)
    assert torch.equal(layer(one), cublas)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "hidden_activation, name, activation",
    [("silu", "silu", silu_and_mul), ("gelu_pytorch_tanh", "gelu_tanh", gelu_tanh_and_mul)],
)
def test_with_the_triton_gemv_a_gated_mlp_runs_the_gated_gemv(hidden_activation, name, activation):
    """Built with `use_triton_gemv`, a GatedMLP's one-row input goes through gated_gemv (gate/up
    and its activation in one kernel), then gemv; without, through cuBLAS and the activation's kernel."""
    config = SimpleNamespace(hidden_activation=hidden_activation, hidden_size=2048, intermediate_size=8192)
    mlp = GatedMLP(config).to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator("cuda").manual_seed(0)
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        shape = linear.weight.shape
        linear.weight.data = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) / 45
    x = torch.randn(1, 2048, generator=gen, device="cuda", dtype=torch.bfloat16)
    gate_up, down = mlp.gate_up_proj.weight, mlp.down_proj.weight
    fused = gemv(gated_gemv(x, gate_up, activation=name), down)
    unfused = F.linear(activation(F.linear(x, gate_up)), down)
    assert not torch.equal(fused, unfused)
    assert torch.equal(apply_kernel_policy(mlp, TRITON_GEMV)(x), fused)
    assert torch.equal(apply_kernel_policy(mlp, PLAIN_CUDA)(x), unfused)


def cuda_kernels(fn) -> list[str]:
    """The names of the CUDA kernels `fn()` launches, in order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@pytest.mark.parametrize("method, block_size", [("int8", (1, 2048)), ("fp8", (128, 128))])
def test_an_int8_gated_mlp_runs_the_quantized_gated_gemv(method, block_size):
    """A GatedMLP with int8 weights sends one CUDA row through quantized_gated_gemv, with or
    without `use_triton_gemv`: two GEMV kernels and no activation kernel, with
    quantized_gated_gemv's output. An fp8 one, and two int8 rows, run the projection, then the
    activation's kernel."""
    config = SimpleNamespace(hidden_activation="silu", hidden_size=2048, intermediate_size=4096)
    mlp = GatedMLP(config).to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator("cuda").manual_seed(0)
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        dense = torch.randn(linear.weight.shape, generator=gen, device="cuda") / 45
        weight, scale = quantize_weight(dense, method, block_size)
        linear.quantize(weight.dtype, block_size)
        linear.weight.data, linear.weight_scale.data = weight, scale
    apply_kernel_policy(mlp, PLAIN_CUDA)
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    one, two = (torch.randn(n, 2048, generator=gen, device="cuda", dtype=torch.bfloat16) for n in (1, 2))
    assert torch.equal(mlp(two), down(silu_and_mul(gate_up(two))))
    assert "_gated_activation_kernel" in cuda_kernels(lambda: mlp(two))
    if method == "fp8":
        assert torch.equal(mlp(one), down(silu_and_mul(gate_up(one))))
        assert cuda_kernels(lambda: mlp(one)) == ["_gemv_kernel", "_gated_activation_kernel", "_gemv_kernel"]
        return
    hidden = quantized_gated_gemv(one, gate_up.weight, gate_up.weight_scale, block_size, activation="silu")
    assert torch.equal(mlp(one), down(hidden))
    for policy in (PLAIN_CUDA, TRITON_GEMV):
        apply_kernel_policy(mlp, policy)
        assert cuda_kernels(lambda: mlp(one)) == ["_gemv_kernel", "_gemv_kernel"]


@pytest.mark.gpu
@pytest.mark.parametrize("act_order", [False, True])
def test_an_int4_gated_mlp_runs_the_int4_gated_gemv(act_order):
    """A GatedMLP with 4-bit weights sends one CUDA row through int4_gated_gemv (x's columns
    gathered first where the weight is in act-order): two GEMV kernels and no activation kernel,
    with int4_gated_gemv's output; two rows run the projection, then the activation's kernel."""
    from infer.kernels import int4_gated_gemv
    from infer.kernels.gemv import int4_linear
    from infer.models.int4_weights import quantize_int4

    config = SimpleNamespace(hidden_activation="silu", hidden_size=2048, intermediate_size=4096)
    mlp = GatedMLP(config).to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator("cuda").manual_seed(0)
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        dense = torch.randn(linear.weight.shape, generator=gen, device="cuda") / 45
        packed = quantize_int4(dense, 128, torch.bfloat16)
        linear.quantize_int4(128, symmetric=False, scale_dtype=torch.bfloat16, act_order=act_order)
        linear.weight.data, linear.weight_scale.data = packed.qweight, packed.scales
        linear.weight_zero.data = packed.zeros
        if act_order:
            linear.input_perm.data = torch.randperm(linear.in_features, generator=gen, device="cuda")
    apply_kernel_policy(mlp, PLAIN_CUDA)
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    one, two = (torch.randn(n, 2048, generator=gen, device="cuda", dtype=torch.bfloat16) for n in (1, 2))
    assert torch.equal(mlp(two), down(silu_and_mul(gate_up(two))))
    assert "_gated_activation_kernel" in cuda_kernels(lambda: mlp(two))
    x = one if gate_up.input_perm is None else one.index_select(-1, gate_up.input_perm)
    hidden = int4_gated_gemv(
        x, gate_up.weight, gate_up.weight_scale, gate_up.weight_zero, 128, activation="silu"
    )
    assert torch.equal(mlp(one), down(hidden))
    kernels = [
        name for name in cuda_kernels(lambda: mlp(one)) if "gather" not in name and "index" not in name
    ]
    # The one-row kernel int4_linear picks: gemv.int4_mma's where Gluon and the GPU take it.
    on_tensor_cores = int4_linear.ONE_ROW_ON_TENSOR_CORES and int4_linear._mma_module(x, 128, 2048)
    one_row = "_int4_mma_gemv_kernel" if on_tensor_cores else "_int4_gemv_kernel"
    assert kernels == [one_row, one_row]


def unfused_norms(x, residual, norm, x_norm) -> tuple[torch.Tensor, torch.Tensor]:
    """(the normed row, the new residual) from the norm's own kernel on a copy of `residual`:
    `add_rms_norm`, or with `x_norm` (a sandwich norm), `rms_norm_add_rms_norm`."""
    from infer.kernels import add_rms_norm, rms_norm_add_rms_norm

    if x_norm is None:
        return add_rms_norm(x, residual.clone(), norm.weight, norm.eps, offset=norm.offset)
    return rms_norm_add_rms_norm(
        x, residual.clone(), x_norm.weight, norm.weight, norm.eps, offset=norm.offset
    )


def built(
    policy: KernelPolicy, norm: RMSNorm, proj: Linear, activation: str | None = None
) -> PreNormProjection:
    """The pre-norm projection of (norm, proj) as `policy` builds it, with the norm's and proj's
    own choices."""
    block = torch.nn.Module()
    block.norm, block.proj = norm, proj
    block.pre_norm = PreNormProjection(norm, proj, activation=activation)
    return apply_kernel_policy(block, policy).pre_norm


@pytest.mark.gpu
@pytest.mark.parametrize("sandwich", [False, True], ids=["add-norm", "norm-add-norm"])
def test_a_pre_norm_projection_of_one_row_runs_the_normed_gemv_with_the_triton_gemv(sandwich):
    """A pre-norm projection built with `use_triton_gemv`, of one CUDA row: one
    `_normed_gemv_kernel`, `normed_gemv`'s output and new residual, the residual passed in left as
    it is. Built without it, and for two rows: the norm's kernel (the residual updated in place),
    then the projection."""
    from infer.kernels import normed_gemv

    gen = torch.Generator("cuda").manual_seed(0)
    hidden, offset = 1152, (1.0 if sandwich else 0.0)
    norm, x_norm = (RMSNorm(hidden, 1e-6, offset=offset).to("cuda", torch.bfloat16) for _ in range(2))
    proj = Linear(hidden, 1536).to("cuda", torch.bfloat16)
    for param in (norm.weight, x_norm.weight, proj.weight):
        param.data = torch.randn(param.shape, generator=gen, device="cuda", dtype=torch.bfloat16) / 8
    extra = dict(x_norm=x_norm) if sandwich else {}
    for rows in (1, 2):
        x, residual = torch.randn(2, rows, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
        normed, expected_residual = unfused_norms(x, residual, norm, x_norm if sandwich else None)
        if rows == 1:
            unfused = built(PLAIN_CUDA, norm, proj).proj(normed)
            fused = built(TRITON_GEMV, norm, proj)
            assert isinstance(fused, NormedGemvProjection)
            kept, spare = residual.clone(), residual.clone()
            kernels = cuda_kernels(lambda x=x, spare=spare, fused=fused: fused(x, spare, **extra))
            out, new_residual = fused(x, residual, **extra)
            assert kernels == ["_normed_gemv_kernel"]
            assert torch.equal(residual, kept)
            weights = (norm.weight, proj.weight)
            x_weight = x_norm.weight if sandwich else None
            expected = normed_gemv(x, residual, *weights, 1e-6, offset=offset, x_norm_weight=x_weight)
            assert torch.equal(out, expected[0]) and torch.equal(new_residual, expected[1])
            # The unfused pair's result, up to the norm's reduction order (test_normed_gemv).
            torch.testing.assert_close(out, unfused, atol=0.05, rtol=0.02)
        pre_norm = built(TRITON_GEMV if rows == 2 else PLAIN_CUDA, norm, proj)
        unfused = proj(normed)
        out, new_residual = pre_norm(x, residual, **extra)
        assert torch.equal(out, unfused) and new_residual is residual
        assert torch.equal(residual, expected_residual)


@pytest.mark.gpu
@pytest.mark.parametrize("sandwich", [False, True], ids=["add-norm", "norm-add-norm"])
@pytest.mark.parametrize("intermediate", [1536, 8192], ids=["one-wave", "two-waves"])
def test_a_gated_mlp_after_its_norm_runs_the_normed_gated_gemv_where_its_grid_is_one_wave(
    sandwich, intermediate
):
    """A gate/up pre-norm projection built with `use_triton_gemv`, of one CUDA row, then down.
    Where the fused kernel's grid is one wave (1536 gate rows: 192 programs),
    `_normed_gated_gemv_kernel` then down's GEMV: `normed_gated_gemv`'s hidden and new residual,
    the residual passed in left as it is, the norm kernel's new residual, and the unfused path's
    output up to the roundings of the normed row (a few units of bf16 at the output's scale).
    Where it is not (8192 rows, 1024 programs, more than 6 an SM), and for two rows: the norm's
    kernel (the residual updated in place), then the MLP."""
    from infer.kernels import normed_gated_gemv, normed_gated_gemv_fills_one_wave

    gen = torch.Generator("cuda").manual_seed(0)
    hidden, offset = 1152, (1.0 if sandwich else 0.0)
    activation = "gelu_pytorch_tanh" if sandwich else "silu"
    config = SimpleNamespace(hidden_activation=activation, hidden_size=hidden, intermediate_size=intermediate)
    mlp = GatedMLP(config).to("cuda", torch.bfloat16)
    norm, x_norm = (RMSNorm(hidden, 1e-6, offset=offset).to("cuda", torch.bfloat16) for _ in range(2))
    for param in (norm.weight, x_norm.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight):
        param.data = torch.randn(param.shape, generator=gen, device="cuda", dtype=torch.bfloat16) / 8
    extra = dict(x_norm=x_norm) if sandwich else {}
    one_wave = normed_gated_gemv_fills_one_wave(2 * intermediate, torch.device("cuda"))
    assert one_wave == (intermediate == 1536), "the H100's and H200's 132 SMs (and any from 32 to 170)"
    apply_kernel_policy(mlp, TRITON_GEMV)
    pre_norm = built(TRITON_GEMV, norm, mlp.gate_up_proj, mlp.activation_name)
    assert isinstance(pre_norm, NormedGemvProjection) == one_wave

    def after_norm(x, residual):
        gated, residual = pre_norm(x, residual, **extra)
        return mlp.down_proj(gated), residual

    for rows in (1, 2):
        x, residual = torch.randn(2, rows, hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
        normed, expected_residual = unfused_norms(x, residual, norm, x_norm if sandwich else None)
        # With the Triton GEMV too: without it one row takes cuBLAS, which sums otherwise.
        unfused = mlp(normed)
        if rows == 1 and one_wave:
            kept, spare = residual.clone(), residual.clone()
            kernels = cuda_kernels(lambda x=x, spare=spare: after_norm(x, spare))
            out, new_residual = after_norm(x, residual)
            x_weight = x_norm.weight if sandwich else None
            fused_hidden, fused_residual = normed_gated_gemv(
                x,
                residual,
                norm.weight,
                mlp.gate_up_proj.weight,
                1e-6,
                activation=mlp.activation_name,
                offset=offset,
                x_norm_weight=x_weight,
            )
            expected = mlp.down_proj(fused_hidden)
            assert kernels == ["_normed_gated_gemv_kernel", "_dense_gemv_kernel"]
            assert torch.equal(residual, kept)
            assert torch.equal(out, expected) and torch.equal(new_residual, fused_residual)
            # The norm kernel's residual; with the sandwich, x's own norm may round otherwise
            # (another reduction order), as test_normed_gemv allows.
            unit, summed = torch.finfo(torch.bfloat16).eps, expected_residual.float()
            joined = 4 * (summed - residual.float()).abs() if sandwich else 0
            assert ((new_residual.float() - summed).abs() <= unit * (summed.abs() / 2 + joined)).all()
            scale = unfused.float().abs().max()
            assert (out.float() - unfused.float()).abs().max() <= 8 * torch.finfo(torch.bfloat16).eps * scale
        else:
            if rows == 1:
                spare = residual.clone()
                kernels = cuda_kernels(lambda x=x, spare=spare: after_norm(x, spare))
                assert kernels == ["_rms_norm_kernel", "_dense_gemv_kernel", "_dense_gemv_kernel"]
            out, new_residual = after_norm(x, residual)
            assert torch.equal(out, unfused) and new_residual is residual
            assert torch.equal(residual, expected_residual)


# -- what the policy picks, and the fused module's contract, on the CPU ---------------------------


def test_the_policy_picks_a_method_per_weight_format_and_device():
    dense, int8, fp8 = Linear(64, 32), Linear(64, 32), Linear(256, 256)
    int8.quantize(torch.int8, (1, 64))
    fp8.quantize(torch.float8_e4m3fn, (128, 128))
    for linear, (name, _) in ((int8, ("int8", None)), (fp8, ("fp8", None))):
        weight, scale = quantize_weight(torch.randn(linear.weight.shape), name, linear.block_size)
        linear.weight.data, linear.weight_scale.data = weight, scale

    def methods(policy):
        return [type(policy.linear_method(linear)).__name__ for linear in (dense, int8, fp8)]

    assert methods(KernelPolicy("cpu")) == ["DenseMethod", "CpuInt8Method", "QuantizedMethod"]
    # Triton options are for CUDA: on a CPU they change nothing.
    assert methods(KernelPolicy("cpu", use_triton_gemv=True, use_pdl=True)) == methods(KernelPolicy("cpu"))
    assert methods(PLAIN_CUDA) == ["DenseMethod", "QuantizedMethod", "QuantizedMethod"]
    assert methods(TRITON_GEMV) == ["TritonGemvMethod", "QuantizedMethod", "QuantizedMethod"]
    assert TRITON_GEMV.linear_method(int8).gated_gemv and not TRITON_GEMV.linear_method(fp8).gated_gemv
    assert KernelPolicy("cuda", use_pdl=True).linear_method(dense).pdl
    assert not KernelPolicy("cpu", use_pdl=True).linear_method(dense).pdl


def test_the_policy_fuses_a_pre_norm_projection_only_where_the_normed_gemv_fits():
    norm = RMSNorm(64, 1e-6)
    plain, with_bias, int8, wide = Linear(64, 96), Linear(64, 96, bias=True), Linear(64, 96), Linear(4096, 96)
    int8.quantize(torch.int8, (1, 64))
    fused = [
        type(policy.pre_norm_projection(PreNormProjection(norm, proj))).__name__
        for policy in (TRITON_GEMV, PLAIN_CUDA, KernelPolicy("cpu", use_triton_gemv=True))
        for proj in (plain, with_bias, int8, wide)
    ]
    assert fused == ["NormedGemvProjection"] + ["PreNormProjection"] * 11


def test_a_fused_pre_norm_projection_gives_normed_gemv_for_one_row_and_the_unfused_pair_for_more():
    """On a CPU the fused kernel runs its reference: one row gives `normed_gemv_ref`'s output and
    new residual, the residual passed in left as it is; two rows give the norm, then the
    projection, the residual updated in place."""
    from infer.kernels import add_rms_norm, normed_gemv_ref

    gen = torch.Generator().manual_seed(0)
    norm, proj = RMSNorm(64, 1e-6), Linear(64, 96)
    for param in (norm.weight, proj.weight):
        param.data = torch.randn(param.shape, generator=gen)
    fused = NormedGemvProjection(norm, proj)
    one, residual = torch.randn(2, 1, 64, generator=gen)
    kept = residual.clone()
    out, new_residual = fused(one, residual)
    expected, expected_residual = normed_gemv_ref(one, residual.clone(), norm.weight, proj.weight, 1e-6)
    assert torch.equal(out, expected) and torch.equal(new_residual, expected_residual)
    assert torch.equal(residual, kept)
    two, residual = torch.randn(2, 2, 64, generator=gen)
    normed, expected_residual = add_rms_norm(two, residual.clone(), norm.weight, 1e-6)
    out, new_residual = fused(two, residual)
    assert torch.equal(out, dense_linear(normed, proj.weight)) and new_residual is residual
    assert torch.equal(residual, expected_residual)


def test_only_one_token_inputs_launch_with_pdl():
    """PDL pays on a batch-1 decode step's one-wave kernels and costs on multi-wave ones
    (infer.models.kernel_policy): a model built with `use_pdl` launches one-token inputs with it."""
    one, two = torch.zeros(1, 8), torch.zeros(2, 8)
    assert launches_pdl(True, one)
    assert not launches_pdl(False, one) and not launches_pdl(True, two)
