"""Run in a subprocess by test_safe_params.py: every way a user may touch a wrapped model's parameters,
under one placement and each dtype. Prints one JSON line per access *before* running it ("start") and
after it ("done", with "value_ok" or "error"), so a crash names the access that caused it."""
import copy
import io
import json
import sys

import torch

import chunkmem as cm
from models import TinyGPT

PLACEMENT = sys.argv[1]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def report(**fields):
    print(json.dumps(fields), flush=True)


def build(dtype):
    torch.manual_seed(0)
    extra = {"offload_param_frac": 0.5, "offload_optim_frac": 0.5} if PLACEMENT == "static" else {}
    model = cm.ShardedModelV2(TinyGPT(), cm.TensorShardStrategy(), tensor_placement_policy=PLACEMENT, dtype=dtype,
                              chunk_size=8192 * dtype.itemsize, **extra)
    optim = cm.ShardedOptimizerV2(model, cm.HybridAdam(model.parameters(), lr=1e-2), initial_scale=2**5)
    return model, optim


def step(model, optim, seed):
    torch.manual_seed(seed)
    x = torch.randint(0, 64, (2, 8))
    optim.backward(model(x).float().pow(2).mean())
    optim.step()
    optim.zero_grad()


def run(dtype_name):
    dtype = DTYPES[dtype_name]
    model, optim = build(dtype)
    twin, twin_optim = build(dtype)
    step(model, optim, 1)
    step(twin, twin_optim, 1)
    p = model.module.blocks[0].fc1.weight
    name = next(n for n, q in model.module.named_parameters() if q is p)
    expected = model.full_parameter(p).to(dtype)  # the value the 16-bit (or fp32) copy holds
    expected_sd = {k: v.to(dtype) for k, v in model.state_dict().items() if v.is_floating_point()}

    def same(value, reference=expected):
        return isinstance(value, torch.Tensor) and torch.equal(value.detach().cpu().to(dtype), reference)

    def saved_and_loaded():
        buffer = io.BytesIO()
        torch.save(model.module.state_dict(), buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)
        return all(torch.equal(loaded[k].to(dtype), v) for k, v in expected_sd.items() if k in loaded)

    def no_grad(fn):
        def run_it():
            with torch.no_grad():
                return fn()
        return run_it

    accesses = {
        "print(model)": lambda: "ShardedModelV2" in repr(model),
        "print(param)": lambda: "Parameter containing" in repr(p) and str(p) == repr(p),
        "param.detach().clone()": lambda: same(p.detach().clone()),
        "param.sum()": lambda: same(p.sum(), expected.sum()),
        "no_grad param.sum()": no_grad(lambda: same(p.sum(), expected.sum())),
        "param.float()": lambda: same(p.float()),
        "no_grad param.float()": no_grad(lambda: same(p.float())),
        "param.data": lambda: same(p.data),
        "param.data.clone()": lambda: same(p.data.clone()),
        "param.grad": lambda: p.grad is None,
        "parameters_to_vector": lambda: same(torch.nn.utils.parameters_to_vector(model.parameters())[:1],
                                             model.full_parameter(next(model.parameters())).to(dtype).reshape(-1)[:1]),
        "no_grad parameters_to_vector": no_grad(lambda: torch.nn.utils.parameters_to_vector(model.parameters()).numel()
                                                == sum(q.numel() for q in model.parameters())),
        "module.state_dict()[key]": lambda: same(model.module.state_dict()[name]),
        "torch.save(module.state_dict())": saved_and_loaded,
        "copy.deepcopy(model)": lambda: copy.deepcopy(model),
        "copy.deepcopy(model.module)": lambda: copy.deepcopy(model.module),
        "model.half()": lambda: model.half(),
        "model.float()": lambda: model.float(),
        "model.to(torch.float64)": lambda: model.to(torch.float64),
        "model.to('cpu')": lambda: model.to("cpu") is model if not torch.cuda.is_available() else True,
        "model.cuda()": lambda: model.cuda(),
        "model.module.half()": lambda: model.module.half(),
        "model.module.to(torch.float64)": lambda: model.module.to(torch.float64),
        "torch.save(param)": lambda: torch.save(p, io.BytesIO()),
        "param.data = zeros": lambda: setattr(p, "data", torch.zeros_like(expected)),
        "clip_grad_norm_ (no grads)": lambda: float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) == 0.0,
    }
    for access, fn in accesses.items():
        report(dtype=dtype_name, access=access, phase="start")
        try:
            result = fn()
        except cm.ChunkmemError as exc:
            report(dtype=dtype_name, access=access, phase="done", error=type(exc).__name__, message=str(exc))
        else:
            report(dtype=dtype_name, access=access, phase="done", value_ok=result is True)
    # after a backward, before the step: torch's clip_grad_norm_ reads the gradient stand-ins (a max_norm that
    # clips nothing: the training below must stay the twin's, bit for bit)
    torch.manual_seed(2)
    optim.backward(model(torch.randint(0, 64, (2, 8))).float().pow(2).mean())
    report(dtype=dtype_name, access="clip_grad_norm_ (grads)", phase="start")
    try:
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
        report(dtype=dtype_name, access="clip_grad_norm_ (grads)", phase="done",
               value_ok=0.0 < norm < float("inf"))
    except cm.ChunkmemError as exc:
        report(dtype=dtype_name, access="clip_grad_norm_ (grads)", phase="done", error=type(exc).__name__,
               message=str(exc))
    optim.step()
    optim.zero_grad()
    torch.manual_seed(2)
    twin_optim.backward(twin(torch.randint(0, 64, (2, 8))).float().pow(2).mean())
    twin_optim.step()
    twin_optim.zero_grad()
    untouched = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))
    report(dtype=dtype_name, access="training unchanged by the accesses", phase="done", value_ok=untouched)


for name in sys.argv[2:]:
    run(name)
