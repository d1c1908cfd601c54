"""Prompt data: reading jsonl/json/parquet/``save_to_disk`` files into tokenised prompts
(:class:`fitrl.data.dataset.PromptDataset`) and drawing them in seeded, resumable batches
(:class:`fitrl.data.dataset.PromptSampler`)."""
