"""HybridAdam / CPUAdam alone, and the flat kernel against an fp64 oracle."""
import copy

import pytest
import torch

import chunkmem as cm
from chunkmem.optim.host_adam_ext import fp32_reference_options
from adam_oracle import adam_fp64
from chunkmem.optim.adam_kernels import adam_update_
from chunkmem.optim.adam_math import AdamHyper


@pytest.mark.parametrize("cls", [cm.HybridAdam, cm.CPUAdam])
@pytest.mark.parametrize("adamw_mode,torch_cls", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_alone_matches_torch(cls, adamw_mode, torch_cls):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    ours = cls(model.parameters(), lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode)
    ref = torch_cls(twin.parameters(), lr=1e-2, weight_decay=0.1, **fp32_reference_options())
    for _ in range(5):
        x = torch.randn(4, 8)
        for m, opt in ((model, ours), (twin, ref)):
            m(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)




@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_flat_kernel_against_fp64(grad_dtype, adamw_mode, bias_correction):
    torch.manual_seed(1)
    n = 10_000
    h = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=adamw_mode,
                  bias_correction=bias_correction)
    master = torch.randn(n)
    m = torch.randn(n) * 0.01
    v = torch.rand(n) * 1e-4
    grad = (torch.randn(n) * 64).to(grad_dtype)
    want_p, want_m, want_v = adam_fp64(master, grad, m, v, 3, h, 1 / 64)
    g = grad.double() / 64
    # fp32 arithmetic: each result within a few fp32 roundings (2^-24) of the sizes of its terms (the
    # constants beta1, beta2, 1 - beta are themselves rounded to fp32 by the kernels: one more each)
    m_terms = h.beta1 * m.double().abs() + (1 - h.beta1) * g.abs()
    v_terms = h.beta2 * v.double() + (1 - h.beta2) * g * g
    out = torch.empty(n, dtype=grad_dtype)
    adam_update_(master, grad, m, v, 3, h, grad_multiplier=1 / 64, param_out=out if grad_dtype != torch.float32 else None)
    ulp = 2.0**-24
    assert ((m.double() - want_m).abs() <= 8 * ulp * m_terms).all()
    assert ((v.double() - want_v).abs() <= 8 * ulp * v_terms).all()
    p_terms = master.double().abs() + h.lr * 10  # the step itself is at most lr / (1 - beta1) in size
    assert ((master.double() - want_p).abs() <= 16 * ulp * p_terms).all()
    if grad_dtype != torch.float32:
        assert torch.equal(out, master.to(grad_dtype))
