"""Expert parallelism's costs: what one MoE layer hands to the collectives, per rank.

The technique: picotron/parallel/expert_parallel.py; the chapter: chapters/07_expert_parallel.ipynb,
which checks both formulas against picotron.comm's counts.
"""

from __future__ import annotations

__all__ = ["ep_comm_per_layer", "ep_comm_bytes"]


def ep_comm_per_layer(sent: int, received: int, hidden: int, num_experts: int, data_size: int,
                      dtype_bytes: int = 4) -> dict[str, dict[str, tuple[int, int]]]:
    """What one ExpertParallelMoE layer hands to the collectives on a rank, as CommCounter counts it.

    sent / received: rows this rank dispatched / received (sum of layer.last_splits[0] / [1]).
    {"forward": {op: (calls, payload bytes)}, "backward": {...}}. Payload = the whole input of
    each all-to-all, the rank's own rows included:

        forward   all-to-all of the counts (E int64), dispatch (sent rows), combine (received rows);
                  all-reduce of the load (E int64) over the data_size data ranks (when more than one)
        backward  the reverse of combine (sent rows) and of dispatch (received rows)
    """
    rows = (sent + received) * hidden * dtype_bytes
    forward = {"all_to_all": (3, 8 * num_experts + rows)}
    if data_size > 1:
        forward["all_reduce"] = (1, 8 * num_experts)
    return {"forward": dict(sorted(forward.items())), "backward": {"all_to_all": (2, rows)}}


def ep_comm_bytes(tokens: int, hidden: int, top_k: int, ep: int, dtype_bytes: int = 4) -> int:
    """Payload bytes of the token all-to-alls of one MoE layer, forward and backward, averaged over the ep ranks.

    Dropless: a rank sends its T k slots (T tokens, k = top_k) in dispatch and gets back as many in
    combine; the rows it receives vary with the routing, but every row sent is received, so over
    the ep ranks they average T k. Four all-to-alls of T k h a bytes (h hidden, a bytes per
    element): 4 T k h a. With a balanced load (ep-1)/ep of it leaves the rank; ep = 1 sends nothing, so 0
    (picotron.comm's counter still records the 4 T k h a a 1-rank all-to-all is handed).
    """
    return 0 if ep == 1 else 4 * tokens * top_k * hidden * dtype_bytes
