"""An fp64 statement of Adam / AdamW, the oracle of the kernel tests."""


def adam_fp64(master, grad, m, v, step, h, multiplier):
    """One Adam step in fp64 from the given fp32 state; returns (param, exp_avg, exp_avg_sq)."""
    g = grad.double() * multiplier
    p = master.double()
    if h.weight_decay != 0:
        if h.adamw_mode:
            p = p * (1 - h.lr * h.weight_decay)
        else:
            g = g + h.weight_decay * p
    m = h.beta1 * m.double() + (1 - h.beta1) * g
    v = h.beta2 * v.double() + (1 - h.beta2) * g * g
    bc1 = 1 - h.beta1 ** step if h.bias_correction else 1
    bc2 = 1 - h.beta2 ** step if h.bias_correction else 1
    p = p - h.lr / bc1 * m / ((v / bc2).sqrt() + h.eps)
    return p, m, v
