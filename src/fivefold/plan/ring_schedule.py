"""Seconds of one ring-attention pass on a rank, walked in the order the runtime posts and waits on its messages.

Ring attention (Liu et al. 2023) hides each K/V hop behind a step of the attention core; the double ring
(LoongTrain, Gu et al. 2024) runs `rounds` rounds of an inner ring of `inner` ranks, each round's first
block arriving over one outer hop posted at the round's start. How much of the traffic a pass exposes
depends on where the runtime waits (parallel/context_parallel.py `_RingAttention`, which the simulator's
`Workload.ring_attention` plays message by message):

- forward, each inner step: post the next K/V hop (all but the round's last step), run 1/ring of the core,
  wait for the hop; so a hop hides behind one step's core, not the whole pass's;
- backward, each inner step as well: after the step's core, wait for the previous step's gradient hop and
  post this step's (the gradient follows its block around the ring); at the round's end wait for the last
  gradient hop (nothing left to hide it) and the previous round's outer gradient hop, then post this round's;
- every round waits for its outer K/V hop at its end; the pass ends waiting for the last outer gradient.

Messages on one channel (the inner ring's, or the outer ring's neighbour) go one after the other at their
alpha-beta time; the two channels run side by side (they reach different peers). Posting each exchange (one
batch_isend_irecv of a send and a receive) takes the rank's own thread `post` seconds (the accelerator's
`post_seconds`: gloo on a CPU writes into the socket from the caller; 0 on GPUs), which nothing hides. This walk is the planner's
price of ring attention (plan/estimate.py `_context_parallel_block`); tests/test_step_simulator.py checks it
against the simulator's contention-free path.
"""

from __future__ import annotations


def ring_pass_seconds(inner: int, rounds: int, chunk: float, inner_message: float, outer_message: float,
                      backward: bool, post_seconds: float = 0.0) -> float:
    """Seconds from the pass's start until its rank is done: `inner` x `rounds` core steps of `chunk` seconds
    each, and the hops of the module docstring at `inner_message` / `outer_message` seconds each, each posted in
    `post_seconds` of the rank's time."""
    now = 0.0
    free = {"inner": 0.0, "outer": 0.0}  # when each channel is next free

    def post(channel: str, seconds: float) -> float:
        nonlocal now
        now += post_seconds
        start = max(now, free[channel])
        free[channel] = start + seconds
        return free[channel]

    pending = outer_pending = None  # backward: the gradient hops in flight (their arrival times)
    for round_ in range(rounds):
        arriving = post("outer", outer_message) if round_ < rounds - 1 else None
        for step in range(inner):
            moving = post("inner", inner_message) if step < inner - 1 else None
            now += chunk
            if backward:
                if pending is not None:
                    now = max(now, pending)
                pending = post("inner", inner_message) if inner > 1 else None
            if moving is not None:
                now = max(now, moving)
        if backward:
            for done in (pending, outer_pending):
                if done is not None:
                    now = max(now, done)
            pending = None
            outer_pending = post("outer", outer_message) if rounds > 1 else None
        if arriving is not None:
            now = max(now, arriving)
    if outer_pending is not None:
        now = max(now, outer_pending)
    return now
