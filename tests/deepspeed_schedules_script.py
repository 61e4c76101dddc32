"""Learning rates (and OneCycle's betas) of DeepSpeed's schedules for the cases of CASES, step by step:

    python tests/deepspeed_schedules_script.py {deepspeed|chunkmem} OUT.json

``test_deepspeed_face.py`` compares chunkmem's schedules with DeepSpeed's output recorded in
``tests/data/deepspeed_reference.json`` (and with a live DeepSpeed when one is installed)."""
from __future__ import annotations

import json
import sys

import torch

CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10}),
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 0.01, "warmup_num_steps": 7, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_num_steps": 1}),
    ("WarmupDecayLR", {"total_num_steps": 25, "warmup_min_lr": 0.0, "warmup_max_lr": 0.02, "warmup_num_steps": 5}),
    ("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 8, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 25, "warmup_min_ratio": 0.1, "warmup_num_steps": 5}),
    ("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 6, "cos_min_ratio": 0.05, "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 6}),
    ("OneCycle", {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 5, "cycle_second_step_size": 3,
                  "decay_step_size": 2, "decay_lr_rate": 0.5, "decay_mom_rate": 0.1, "cycle_first_stair_count": 2}),
]
STEPS = 30


def run(schedules: object) -> list:
    out = []
    for kind, params in CASES:
        params = dict(params)
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "lr": 5e-3}], lr=1e-2)
        schedule = getattr(schedules, kind)(optimizer, **params)
        rows = [[[g["lr"], list(g["betas"])] for g in optimizer.param_groups]]
        for _ in range(STEPS):
            schedule.step()
            rows.append([[g["lr"], list(g["betas"])] for g in optimizer.param_groups])
        out.append({"type": kind, "params": params, "rows": rows, "state": schedule.state_dict()})
    return out


if __name__ == "__main__":
    if sys.argv[1] == "deepspeed":
        from deepspeed.runtime import lr_schedules as schedules
    else:
        from chunkmem.deepspeed import lr_schedules as schedules
    with open(sys.argv[2], "w") as f:
        json.dump(run(schedules), f)
