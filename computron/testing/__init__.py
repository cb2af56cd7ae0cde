"""Fixtures: hub-free models and checkpoints with seeded random weights, for tests, examples and benchmarks.

- ``zoo``: OPT and Llama shapes by name, random causal LMs and their checkpoints, an MLP, an echo module,
  and the unsharded reference a served model must match token for token;
- ``zoo_understanding``: random BERT, RoBERTa and ViT models with task heads and label sets, written with
  their tokenizer or image processor;
- ``tokenizer_zoo``: the one tokenizer trainer (byte-level BPE for the causal LMs and RoBERTa, WordPiece
  for BERT) on text that ships with this package, and checkpoints saved with a tokenizer;
- ``zoo_lora``: PEFT LoRA adapters with seeded random A and B (both non-zero) for the causal-LM checkpoints.
- ``hub_cache``: a Hugging Face hub cache in huggingface_hub's layout, written from local files (hub ids offline).

Nothing here is production code: the loaders that read such checkpoints (``computron serve``'s) live in
:mod:`computron.loading`. ``computron.zoo``, ``computron.zoo_understanding`` and
``computron.tokenizer_zoo`` remain as names for these modules (with the loaders they used to hold).
"""
