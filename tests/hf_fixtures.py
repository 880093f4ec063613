"""A Qwen3-style tokenizer directory, built in-process (nothing is downloaded).

`write_qwen_tokenizer(path)` writes what a Qwen3 checkpoint ships next to its weights:

    tokenizer.json          a byte-level BPE (trained here on a few math texts) with the
                            added tokens <|endoftext|>, <|im_start|>, <|im_end|> (special)
                            and <think>, </think> (added, not special: as in Qwen3, so
                            decoding keeps them and the reward can find the think block)
    tokenizer_config.json   eos <|im_end|>, pad <|endoftext|>, no BOS, and a compact but
                            faithful copy of Qwen3's jinja chat template (system message,
                            user/assistant turns, prior thinking stripped from assistant
                            turns, `enable_thinking=false` inserting an empty think block)
    generation_config.json  eos_token_id [<|im_end|>, <|endoftext|>] (Qwen3's two stops)

It returns the `tokenizers.Tokenizer`, so tests can look ids up.
"""
from __future__ import annotations

import json
import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
THINK = ("<think>", "</think>")
TEXTS = ("What is 12 + 7?", "The answer is 19.", "Let's think step by step: 3 * 4 = 12.",
         "#### 42", "Please reason step by step, and put your final answer within "
         "\\boxed{}.", "So the answer is \\boxed{\\frac{1}{2}}.", "You are a helpful "
         "assistant.", "system user assistant", "Find the value of x if 2x + 3 = 11.")

QWEN3_CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {%- set content = message.content %}\n"
    "        {%- if '</think>' in content %}\n"
    "            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}\n"
    "    {%- elif message.role != 'system' %}\n"
    "        {{- raise_exception('Unexpected message role: ' + message.role) }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n")


def write_qwen_tokenizer(path, *, chat_template: str | None = QWEN3_CHAT_TEMPLATE,
                         vocab_size: int = 400) -> Tokenizer:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json (module
    docstring) into the existing directory `path`; `chat_template=None` omits the
    template. The tokenizer has at most `vocab_size` + 5 tokens."""
    path = str(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    tok.save(os.path.join(path, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIALS + THINK}
    added = {str(i): {"content": t, "special": t in SPECIALS, "lstrip": False,
                      "rstrip": False, "normalized": False, "single_word": False}
             for t, i in ids.items()}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "bos_token": None, "add_bos_token": False,
              "model_max_length": 4096, "added_tokens_decoder": added}
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
                   "pad_token_id": ids["<|endoftext|>"]}, f)
    return tok
