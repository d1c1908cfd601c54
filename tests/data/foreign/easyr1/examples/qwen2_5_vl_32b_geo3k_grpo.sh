# from hiyouga/EasyR1 examples/qwen2_5_vl_32b_geo3k_grpo.sh at b44b311b669bf1fd1aa2fc36f2251482ba33cb16 (Apache-2.0), a test input of fitrl import-config
#!/bin/bash

set -x

MODEL_PATH=Qwen/Qwen2.5-VL-32B-Instruct  # replace it with your local file path

python3 -m verl.trainer.main \
    config=examples/config.yaml \
    data.train_files=hiyouga/geometry3k@train \
    data.val_files=hiyouga/geometry3k@test \
    worker.actor.model.model_path=${MODEL_PATH} \
    worker.actor.fsdp.torch_dtype=bf16 \
    worker.actor.optim.strategy=adamw_bf16 \
    worker.rollout.tensor_parallel_size=8 \
    trainer.experiment_name=qwen2_5_vl_32b_geo_grpo \
    trainer.n_gpus_per_node=8
