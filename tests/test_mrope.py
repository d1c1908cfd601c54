"""Qwen2-VL / Qwen2.5-VL rotary positions (fitrl/models/families/qwen_vl/mrope.py): hand-computed runs, the
same numbers as transformers' ``get_rope_index`` wherever transformers follows the released
layout, and the released layout where it does not (text after a long video)."""

from __future__ import annotations

import pytest
import torch

from fitrl.models.families.qwen_vl.mrope import rope_index, sequence_positions, vision_run_positions

T, I, V = 0, 1, 2  # token types: text, image pad, video pad


def test_vision_run_by_hand():
    # grid (2, 4, 4) merged 2x2: 2 x 2 x 2 tokens from position 5, temporal step 1.5 -> 0, 1
    pos = vision_run_positions(5, (2, 4, 4), 2, 1.5)
    assert pos.tolist() == [[5, 5, 5, 5, 6, 6, 6, 6], [5, 5, 6, 6, 5, 5, 6, 6], [5, 6, 5, 6, 5, 6, 5, 6]]
    assert vision_run_positions(0, (3, 2, 2), 2, 2.0)[0].tolist() == [0, 2, 4]


def test_text_after_a_video_resumes_after_its_last_temporal_position():
    # 2 text, a video of grid (3, 2, 2) (3 tokens) with step 4 (Qwen2.5-VL: tokens_per_second 2
    # x 2 s per grid), 2 text: the video's temporal positions are 2, 6, 10, so the text goes on at 11
    pos = sequence_positions([T, T, V, V, V, T, T], [], [(3, 2, 2)], [4.0], merge=2)
    assert pos.tolist() == [[0, 1, 2, 6, 10, 11, 12], [0, 1, 2, 2, 2, 11, 12], [0, 1, 2, 2, 2, 11, 12]]
    # an image of 2 x 3 merged tokens: text resumes after its widest axis
    pos = sequence_positions([T, I, I, I, I, I, I, T], [(1, 4, 6)], [], [], merge=2)
    assert pos[:, -1].tolist() == [4, 4, 4] and pos[2, 1:7].tolist() == [1, 2, 3, 1, 2, 3]


def test_batch_padding_deltas_and_grids_consumed_in_order():
    types = torch.tensor([[0, 0, T, I, T, V, V, T],  # left padding, an image (grid 1x2x2 -> 1 token), a video
                          [T, V, V, V, V, T, T, T]])  # another video (grid 2x2x4: 4 tokens) in the second row
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8])
    pos, deltas = rope_index(types, mask, torch.tensor([[1, 2, 2]]), torch.tensor([[2, 2, 2], [2, 2, 4]]),
                             torch.tensor([0.5, 1.0]), merge=2, tokens_per_second=4)
    assert pos[:, 0, :2].eq(0).all()  # padding
    # row 0: text 0, image 1, text 2, video steps 2 (4 x 0.5) from 3: temporal 3, 5; text at 6
    assert pos[0, 0, 2:].tolist() == [0, 1, 2, 3, 5, 6]
    # row 1: video steps 4 from 1, grid 2 x (1 x 2): temporal 1, 1, 5, 5; width 1, 2; text from 6
    assert pos[0, 1].tolist() == [0, 1, 1, 5, 5, 6, 7, 8] and pos[2, 1].tolist() == [0, 1, 2, 1, 2, 6, 7, 8]
    assert deltas.tolist() == [[7 - 6], [9 - 8]]  # max position + 1 - real tokens
    with pytest.raises(ValueError, match="does not match its grid"):
        rope_index(torch.tensor([[T, I, I, T]]), None, torch.tensor([[1, 2, 2]]), None, None, merge=2,
                   tokens_per_second=None)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def backbone_of(request, tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    from fitrl.models.families.qwen_vl import backbone
    from fitrl.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, size="tiny", seed=0)
    return backbone(AutoModelForImageTextToText.from_pretrained(path))


def test_equals_transformers_where_transformers_follows_the_released_layout(backbone_of):
    """Images, and videos whose temporal positions stay within their width: transformers' numbers."""
    from fitrl.models.families.qwen_vl.family import use_released_positions

    inner = backbone_of
    cfg = inner.config
    merge = cfg.vision_config.spatial_merge_size
    image, video = cfg.image_token_id, cfg.video_token_id
    # video grid (2, 4, 8): 2 x 2 x 4 = 16 tokens, temporal positions 0 and 1 x step <= width 4
    ids = torch.tensor([[7, 7, 8] + [image] * 4 + [9] + [video] * 16 + [10, 11, 12, 13, 14],
                        [5] * 6 + [7] + [video] * 16 + [8] + [image] * 4 + [9]])
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    grids = dict(image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]), video_grid_thw=torch.tensor([[2, 4, 8]] * 2),
                 second_per_grid_ts=torch.tensor([0.5, 0.25]))
    types = (ids == image).int() + 2 * (ids == video).int()
    theirs = type(inner).get_rope_index(inner, ids, mm_token_type_ids=types, attention_mask=mask, **grids)
    tps = getattr(cfg.vision_config, "tokens_per_second", None) if cfg.model_type == "qwen2_5_vl" else None
    ours = rope_index(types, mask, merge=merge, tokens_per_second=tps, **grids)
    assert torch.equal(ours[0][:, mask.bool()], theirs[0][:, mask.bool()])
    assert torch.equal(ours[1].flatten(), theirs[1].flatten())
    # installed on the instance: generate and the trainer's positions call it
    use_released_positions(inner)
    assert torch.equal(inner.get_rope_index(ids, mm_token_type_ids=types, attention_mask=mask, **grids)[0], ours[0])
