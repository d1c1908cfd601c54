"""Prompt data: reading jsonl/json/parquet/``save_to_disk`` files into tokenised prompts
(:class:`fitrl.data.dataset.PromptDataset`) and drawing them in seeded, resumable batches
(:class:`fitrl.data.dataset.PromptSampler`); for vision-language policies, images and videos
checked at start-up and turned into model inputs per batch (:mod:`fitrl.data.images`,
:mod:`fitrl.data.media`, which a vision-language family implements;
docs/vision.md)."""
