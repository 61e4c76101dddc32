"""Every way the issue lists of touching a wrapped model's parameters, each in a subprocess (a crash
must show as a failed exit code, not kill the test run), under every placement and dtype: the process
exits 0 and each access gives the correct value or the documented error."""
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)

# access -> what it must give: "value" (correct value), or the error class and a phrase of its message
EXPECTED = {
    "print(model)": "value",
    "print(param)": "value",
    "param.detach().clone()": "value",
    "param.sum()": ("ParameterAccessError", "would need a gradient"),
    "no_grad param.sum()": "value",
    "param.float()": ("ParameterAccessError", "would need a gradient"),
    "no_grad param.float()": "value",
    "param.data": "value",
    "param.data.clone()": "value",
    "param.grad": "value",
    "parameters_to_vector": ("ParameterAccessError", "would need a gradient"),
    "no_grad parameters_to_vector": "value",
    "module.state_dict()[key]": "value",
    "torch.save(module.state_dict())": "value",
    "copy.deepcopy(model)": ("ParameterAccessError", "copy.deepcopy"),
    "copy.deepcopy(model.module)": ("ParameterAccessError", "copy.deepcopy"),
    "model.half()": ("ParameterAccessError", "belong to chunkmem"),
    "model.float()": ("ParameterAccessError", "belong to chunkmem"),
    "model.to(torch.float64)": ("ParameterAccessError", "belong to chunkmem"),
    "model.to('cpu')": "value",
    "model.cuda()": ("ParameterAccessError", "belong to chunkmem"),
    "model.module.half()": ("ParameterAccessError", "assigning .data"),
    "model.module.to(torch.float64)": ("ParameterAccessError", "assigning .data"),
    "torch.save(param)": ("ParameterAccessError", "pickling"),
    "param.data = zeros": ("ParameterAccessError", "assigning .data"),
    "clip_grad_norm_ (no grads)": "value",
    "clip_grad_norm_ (grads)": "value",
    "training unchanged by the accesses": "value",
}


@pytest.mark.parametrize("placement", ["cpu", "cuda", "auto", "static"])
def test_every_access_is_safe(placement):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "safe_access_child.py"), placement, "fp32", "fp16", "bf16"],
                          capture_output=True, text=True, env=env, timeout=600)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    started = [line for line in lines if line["phase"] == "start"]
    assert proc.returncode == 0, (f"exit code {proc.returncode} during {started[-1] if started else None}:\n"
                                  f"{proc.stderr[-3000:]}")
    done = [line for line in lines if line["phase"] == "done"]
    assert {(d["dtype"], d["access"]) for d in done} == {(t, a) for t in ("fp32", "fp16", "bf16") for a in EXPECTED}
    for outcome in done:
        want = EXPECTED[outcome["access"]]
        where = f"{placement} {outcome['dtype']} {outcome['access']}: {outcome}"
        if want == "value":
            assert outcome.get("value_ok") is True, where
        else:
            assert outcome.get("error") == want[0] and want[1] in outcome["message"], where
