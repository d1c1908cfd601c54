# from hiyouga/EasyR1 examples/qwen2_5_vl_7b_geo3k_gspo.sh at b44b311b669bf1fd1aa2fc36f2251482ba33cb16 (Apache-2.0), a test input of fitrl import-config
#!/bin/bash

set -x

MODEL_PATH=Qwen/Qwen2.5-VL-7B-Instruct  # replace it with your local file path

python3 -m verl.trainer.main \
    config=examples/config.yaml \
    data.train_files=hiyouga/geometry3k@train \
    data.val_files=hiyouga/geometry3k@test \
    worker.actor.model.model_path=${MODEL_PATH} \
    worker.actor.loss_type=gspo_token \
    worker.actor.loss_avg_mode=seq \
    worker.actor.clip_ratio_low=3e-4 \
    worker.actor.clip_ratio_high=4e-4 \
    algorithm.disable_kl=True \
    trainer.experiment_name=qwen2_5_vl_7b_geo_gspo \
    trainer.n_gpus_per_node=8
