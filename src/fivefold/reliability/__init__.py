"""Trusting a long run: verified checkpoints, no code from files, the non-finite guard, heartbeats and the
watchdog, the launcher lifeline, fault injection and failure diagnosis (docs/reliability.md).

    manifest.py    checksummed manifests of checkpoints and exports, verified on every read
    safe_dcp.py    reading torch.distributed.checkpoint folders without unpickling arbitrary objects
    verify.py      `fivefold verify`: a checkpoint, a run folder or an export, file by file
    guard.py       skip non-finite steps, roll back after K, stop after R rollbacks; loss spikes
    activity.py    what each rank is doing (phases, communication sequence numbers)
    heartbeat.py   per-rank heartbeats and the watchdog: hung ranks, stalled collectives
    lifeline.py    workers die with their launcher
    faults.py      fault injection at a chosen step and rank
    events.py      per-rank event logs and failure.json
    supervisor.py  all of it as one component the training loop calls at fixed points
    diagnose.py    `fivefold diagnose`: the failure class, culprit and evidence of a run
"""
