"""The reference GPT's ``UpcastLinear``: fp32 matmuls on 16-bit tensors, through reused host buffers, give
the bits of autograd's own fp32 linear on upcast copies."""
import copy
import threading

import pytest
import torch
import torch.nn.functional as F

from chunkmem.gpt import GPT, GPTConfig, UpcastLinear
from tests.models import upcast_by_autograd


def _autograd_reference(layer: UpcastLinear, x: torch.Tensor, grad: torch.Tensor):
    """The output and gradients of ``F.linear`` on fp32 copies, cast back as UpcastLinear casts them."""
    weight, bias = (t.detach().requires_grad_() for t in (layer.weight, layer.bias))
    x = x.detach().requires_grad_()
    out = F.linear(x.float(), weight.float(), bias.float()).to(x.dtype)
    out.backward(grad)
    return out, x.grad, weight.grad, bias.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_upcast_linear_equals_autograds_fp32_linear_through_layers_of_other_shapes(dtype):
    """Layers of growing and shrinking weights share the buffers; each one's output and gradients are bitwise
    autograd's, and the outputs and gradients handed out are not overwritten by later layers."""
    torch.manual_seed(0)
    layers = [UpcastLinear(i, o).to(dtype) for i, o in ((24, 40), (40, 96), (96, 16))]
    expected, h = [], torch.randn(3, 5, 24, dtype=dtype)
    for layer in layers:
        grad = torch.randn(3, 5, layer.out_features, dtype=dtype)
        expected.append((h, grad, *_autograd_reference(layer, h, grad)))
        h = expected[-1][2].detach()
    inputs = [h_in.clone().requires_grad_() for h_in, *_ in expected]
    outputs = [layer(h_in) for layer, h_in in zip(layers, inputs)]  # every forward, then every backward
    for out, (_, grad, *_) in reversed(list(zip(outputs, expected))):
        out.backward(grad)
    for layer, h_in, out, (_, _, ref_out, ref_x, ref_w, ref_b) in zip(layers, inputs, outputs, expected):
        assert torch.equal(out, ref_out) and torch.equal(h_in.grad, ref_x)
        assert layer.weight.grad.dtype == dtype and torch.equal(layer.weight.grad, ref_w)
        assert torch.equal(layer.bias.grad, ref_b)


def test_upcast_linear_on_two_threads_at_once():
    """Each thread has its own buffers: two threads stepping the same shapes at once get autograd's bits."""
    torch.manual_seed(1)
    layer = UpcastLinear(512, 1024).to(torch.bfloat16)  # (matmuls long enough to overlap)
    inputs = [torch.randn(64, 512, dtype=torch.bfloat16) for _ in range(2)]
    grads = [torch.randn(64, 1024, dtype=torch.bfloat16) for _ in range(2)]
    references = [_autograd_reference(layer, x, g) for x, g in zip(inputs, grads)]
    found, barrier = [None, None], threading.Barrier(2)

    def run(k):
        barrier.wait()
        for _ in range(40):
            x = inputs[k].clone().requires_grad_()
            out = layer(x)
            weight_grad, = torch.autograd.grad(out, [layer.weight], grads[k])
        found[k] = (out, weight_grad)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for (out, weight_grad), (ref_out, _, ref_w, _) in zip(found, references):
        assert torch.equal(out, ref_out) and torch.equal(weight_grad, ref_w)


def test_the_upcast_gpt_trains_as_the_gpt_on_fp32_copies():
    """A step of the reference GPT built with ``upcast=True`` gives the same bits as the same model whose
    linear layers upcast through autograd."""
    cfg = GPTConfig(vocab=64, d_model=32, layers=2, heads=4, seq=8)
    torch.manual_seed(2)
    upcast = GPT(cfg, upcast=True).to(torch.bfloat16)
    plain = upcast_by_autograd(copy.deepcopy(upcast))
    tokens = torch.randint(0, 64, (2, 9))
    for model in (upcast, plain):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, 64), tokens[:, 1:].reshape(-1)).backward()
    for (name, a), b in zip(upcast.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_upcast_linear_under_create_graph_takes_new_tensors():
    """A backward autograd records (``create_graph=True``: a gradient penalty) gets the same first gradients and
    can be differentiated again; the reused buffers would be written under autograd's saved tensors."""
    torch.manual_seed(3)
    layer = UpcastLinear(16, 8).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(4, 8, dtype=torch.bfloat16)
    _, ref_x, ref_w, _ = _autograd_reference(layer, x, grad)
    out = layer(x)
    grad_x, grad_w = torch.autograd.grad(out, [x, layer.weight], grad, create_graph=True)
    assert torch.equal(grad_x, ref_x) and torch.equal(grad_w, ref_w)
    penalty, = torch.autograd.grad(grad_w.float().pow(2).sum(), [x])
    assert penalty.shape == x.shape and torch.isfinite(penalty).all()
