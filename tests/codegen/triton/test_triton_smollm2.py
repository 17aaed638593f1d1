"""The bundled SmolLM2-135M (real weights) on the triton backend: greedy tokens are Hugging Face's.

On CUDA this is the end-to-end equivalence check of tests/test_smollm2.py (eight
chat prompts, 64 greedy tokens each, batched). On CPU the kernels run in
Triton's interpreter, about a hundred times slower, so the check is the
same on a short prompt and three tokens.

Each generated token is checked under teacher forcing: HF fp32 (eager) is
fed the prompt plus the tokens generated so far, and the token must be its
argmax, or within 1e-3 of the top logit (a near tie that another, equally
valid fp32 summation order may break the other way).
"""

from __future__ import annotations

import pytest
import torch

from octavo.llm import LLM
from octavo.runtime.sampling_params import SamplingParams
from tests.test_smollm2 import QUESTIONS

pytestmark = pytest.mark.slow

TIE_MARGIN = 1e-3


def prompts_for(device: torch.device, tokenizer) -> tuple[list[list[int]], int]:
    if device.type == "cuda":
        chats = [[{"role": "user", "content": question}] for question in QUESTIONS]
        return [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
                for chat in chats], 64
    return [tokenizer.encode("The capital of France is")], 3


def test_greedy_tokens_are_hf_argmax(smollm2_fp32_artifact, smollm2_hf_fp32, smollm2_source, device):
    prompts, num_tokens = prompts_for(device, smollm2_source.tokenizer)
    llm = LLM(smollm2_fp32_artifact, backend="triton", device=device.type, num_kv_blocks=512)
    assert llm.engine.backend == "triton"
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True))
    exact = 0
    for index, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        ours = output.outputs[0].token_ids
        assert len(ours) == num_tokens
        with torch.no_grad():
            logits = smollm2_hf_fp32(torch.tensor([prompt + ours[:-1]])).logits[0, len(prompt) - 1:].float()
        chosen = logits.gather(1, torch.tensor(ours).unsqueeze(1)).squeeze(1)
        gaps = logits.max(dim=1).values - chosen
        worst = int(gaps.argmax())
        assert float(gaps[worst]) <= TIE_MARGIN, (
            f"prompt {index}: token {worst} ({ours[worst]}) is {float(gaps[worst]):.4f} below HF's top logit")
        exact += int((gaps == 0).sum())
    assert exact >= 0.95 * num_tokens * len(prompts), f"only {exact} tokens are HF's exact argmax"
