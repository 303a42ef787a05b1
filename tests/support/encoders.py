"""Small random-weight encoder checkpoints (BERT, XLM-RoBERTa) with a word-level BERT tokenizer,
saved as HF folders, for the encoder parity and scoring-route tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = ("the a cat dog sat on mat paris france capital is what of city river sea blue red green big small "
         "where lives fish bird tree house car road sun moon star rain snow wind cold hot").split()
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]


def build_encoder(arch: str, folder: Path, seed: int = 0, *, pooling: str | None = None, **overrides) -> Path:
    """Save a random `arch` (BertModel, BertForSequenceClassification, XLMRobertaModel,
    XLMRobertaForSequenceClassification) with the word-level tokenizer; `pooling` ("MEAN"/"CLS")
    adds sentence-transformers' modules.json and 1_Pooling/config.json."""
    import transformers
    from transformers import BertConfig, BertTokenizer, XLMRobertaConfig

    common = {**dict(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=66, initializer_range=0.2), **overrides}
    config = (BertConfig(**common, type_vocab_size=2) if arch.startswith("Bert")
              # pad_token_id 0 ([PAD], never in a prompt): HF numbers positions past pad tokens only.
              else XLMRobertaConfig(**common, type_vocab_size=1, pad_token_id=0))
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    model.save_pretrained(folder)
    BertTokenizer(vocab={word: i for i, word in enumerate(VOCAB)}).save_pretrained(folder)
    if pooling is not None:
        (folder / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": config.hidden_size, "pooling_mode_cls_token": pooling == "CLS",
            "pooling_mode_mean_tokens": pooling == "MEAN"}))
    return folder
