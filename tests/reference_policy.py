"""A deliberately plain, loop-by-loop transcription of SPEC sections 4 and 5, used only as
the reference the vectorised policy is checked against."""

import math


def reference_decisions(norm_rows, alpha, beta, delta, max_o, t_lock, warmup, eps=1e-12):
    n = len(norm_rows[0])
    history = [[] for _ in range(n)]  # accepted norms
    gnmr_history = [[] for _ in range(n)]  # defined GNMR values
    locks = [0] * n
    out = []
    for t, norms in enumerate(norm_rows, start=1):
        gnmr, dgnmr, risk, risky = [], [], [], []
        for u in range(n):
            x = norms[u]
            finite = math.isfinite(x)
            g = math.nan
            if finite and len(history[u]) >= 1:
                g = x / max(sum(history[u]) / len(history[u]), eps)
            d = math.nan
            if not math.isnan(g) and len(gnmr_history[u]) >= delta:
                window = gnmr_history[u][-delta:]
                d = g / max(sum(window) / delta, eps)
            scores = [s for s in (g / alpha, d / beta) if not math.isnan(s)]
            r = max(scores) if scores else 0.0
            is_risky = (not math.isnan(g) and g > alpha) or (not math.isnan(d) and d > beta)
            if t <= warmup:
                is_risky = False
            if not finite:
                is_risky, r = True, math.inf
            gnmr.append(g), dgnmr.append(d), risk.append(r), risky.append(is_risky)
        pool = [u for u in range(n) if risky[u] or locks[u] > 0]
        pool.sort(key=lambda u: (-risk[u], u))
        selected = sorted(pool[:max_o])
        for u in range(n):
            if u in selected and risky[u]:
                locks[u] = t_lock
            elif locks[u] > 0 and not risky[u]:
                locks[u] -= 1
        for u in range(n):
            if math.isfinite(norms[u]):
                history[u].append(norms[u])
            if not math.isnan(gnmr[u]):
                gnmr_history[u].append(gnmr[u])
        out.append({"recovery": tuple(selected), "locks": list(locks), "risky": risky,
                    "gnmr": gnmr, "delta_gnmr": dgnmr, "risk": risk, "pool_size": len(pool)})
    return out
