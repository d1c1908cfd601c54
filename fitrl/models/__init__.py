"""Models: loading local Hugging Face checkpoints, model families, tiny local models.

- :mod:`~fitrl.models.loading`   ``check_model_dir``, ``load_tokenizer``, ``build_model`` (plain or FSDP2-sharded)
- :mod:`~fitrl.models.families`  how each architecture family is built, sharded and fed (``family_for``)
- :mod:`~fitrl.models.tiny`      tiny random-weight causal LMs built on this machine, for tests and demos
"""
