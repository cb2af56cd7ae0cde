"""transformers' own scores of token sequences (the GGUF file as transformers reads it, dequantized to float32,
through the metadata directory ``storage.gguf.convert`` wrote), to check the numbers a client computed from the
server's logprobs."""
from typing import List

import torch


class ReferenceScorer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer

        from computron.loading import load_causal_lm
        self.tok = AutoTokenizer.from_pretrained(path)
        self.model = load_causal_lm(path, dtype="float32").eval()

    def encode(self, text: str) -> List[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def logprob(self, ids: List[int], start: int) -> float:
        """The sum of log p(ids[i] | ids[:i]) for i from ``start`` (>= 1) on."""
        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        return float(sum(lp[i - 1, ids[i]] for i in range(start, len(ids))))

    def continuation(self, context: str, continuation: str) -> float:
        """log p(continuation | context) as lm-eval tokenizes the pair: the whole, split after the context's
        tokens (no BOS added)."""
        whole, ctx = self.encode(context + continuation), self.encode(context)
        return self.logprob(whole, len(ctx))
