"""FSDP2 (``torch.distributed.fsdp.fully_shard``): each decoder layer (and vision block) one unit,
then the root, on a 1-D or a (replicate, shard) mesh; options in a role's ``fsdp:`` section
(``fitrl.config.FSDPConfig``). Its runtime (:mod:`.runtime`) and its memory plan (:mod:`.plan`)."""

from fitrl.sharding.fsdp2 import plan, runtime  # noqa: F401  (register "fsdp2")
