"""``fitrl doctor``: the self-test a user runs on a new node before a real run (docs/doctor.md).

A ladder of rungs, each one line (pass, fail with its cause and fix, or skip with the reason)
and an entry of a JSON report. Every rung runs in processes of its own (one per device for the
node's collectives), under its own time limit, so a hung collective or a crashed kernel fails
that rung and not the ladder; a rung whose prerequisite failed is skipped, naming it.

- :mod:`~fitrl.doctor.ladder`      the rungs, their order and dependencies; results and their lines
- :mod:`~fitrl.doctor.runner`      the parent's side: sessions of child processes, time limits, merging ranks
- :mod:`~fitrl.doctor.child`       a child's side: one rank running its session's rungs
- :mod:`~fitrl.doctor.devices`     devices (CUDA, driver, a matmul per device) and the attention kernels
- :mod:`~fitrl.doctor.collective`  all-reduce across the node's devices, and across nodes under Ray
- :mod:`~fitrl.doctor.training`    FSDP2 shard / gather / step, and checkpoint save / resume / step
- :mod:`~fitrl.doctor.engine`      the rollout engine: generate, sleep, wake, push, log-probs agreeing
- :mod:`~fitrl.doctor.memory`      the memory plan against measured memory per phase on a small shape
- :mod:`~fitrl.doctor.command`     the ``fitrl doctor`` subcommand (argument checks, exit status)

Import-light: importing the package (or ``command``) loads no torch; the rungs import it in
their own processes.
"""
