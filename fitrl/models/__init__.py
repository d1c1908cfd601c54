"""Models: loading local Hugging Face checkpoints, model families, tiny local models.

- :mod:`~fitrl.models.loading`   ``check_on_this_node``, ``load_tokenizer``, ``build_model`` (plain or FSDP2-sharded)
- :mod:`~fitrl.models.families`  how each architecture family is built, sharded and fed (``family_for``)
- :mod:`~fitrl.models.description` each model directory as the run read it once (``ModelDescription``, ``RunModels``)
- :mod:`~fitrl.models.tiny`      tiny random-weight causal LMs built on this machine, for tests and demos
"""
