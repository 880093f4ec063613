"""A Qwen3-style tokenizer directory, built in-process (nothing is downloaded).

`write_qwen_tokenizer(path)` writes what a Qwen3 checkpoint ships next to its weights:

    tokenizer.json          a byte-level BPE (trained here on a few math texts) with the
                            added tokens <|endoftext|>, <|im_start|>, <|im_end|> (special)
                            and <think>, </think> (added, not special: as in Qwen3, so
                            decoding keeps them and the reward can find the think block)
    tokenizer_config.json   eos <|im_end|>, pad <|endoftext|>, no BOS, and Qwen3's jinja
                            chat template less its tool calls (system message, user /
                            assistant turns, the thinking of assistant turns before the
                            last user message dropped, a think block around the later
                            ones, `enable_thinking=false` inserting an empty think block)
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
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == 'user' %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {%- set content = message.content %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if '</think>' in message.content %}\n"
    "            {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + "
    "reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
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

# A ChatML template that renders every turn as written (no turn rewritten): a multi-turn
# chat is one training sequence.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


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


def write_qwen3_moe(path, tok: Tokenizer, *, max_positions: int = 128) -> None:
    """A tiny random Qwen3MoeForCausalLM saved in bfloat16 into `path` (needs torch and
    transformers). The unembedding rows of the two stop ids are both 2.5·e_0: where the
    final hidden state has ĥ_0 > 0 both get the logit 2.5·ĥ_0, so a row stops on either
    one with even odds, or runs out of budget (truncated). save_pretrained writes its own
    generation_config.json: write the tokenizer again afterwards."""
    import torch
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False,
        max_position_embeddings=max_positions, rope_theta=10_000.0, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        head = model.lm_head.weight
        for stop in ("<|im_end|>", "<|endoftext|>"):
            head[tok.token_to_id(stop)] = 0.0
            head[tok.token_to_id(stop), 0] = 2.5
    model.to(torch.bfloat16).save_pretrained(str(path))


def write_jsonl(path, rows) -> str:
    """`rows` (JSON values) as a JSONL file at `path`; returns the path as a string."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_recipe_dirs(root, pairs=((3, 4), (12, 7), (2, 2), (5, 6))):
    """(checkpoint dir, data dir, tokenizer) under `root` (a pathlib.Path): a tiny
    Qwen3-MoE with the Qwen-style tokenizer (positions up to 256), and MATH-shaped data:
    train.jsonl asking the sums of `pairs` with boxed solutions, and aime24.jsonl, an
    AIME-shaped set of two problems."""
    ckpt, data = root / "ckpt", root / "data"
    ckpt.mkdir()
    data.mkdir()
    tok = write_qwen_tokenizer(ckpt)
    write_qwen3_moe(ckpt, tok, max_positions=256)
    write_qwen_tokenizer(ckpt)  # save_pretrained wrote its own generation_config.json
    write_jsonl(data / "train.jsonl", [
        {"problem": f"What is {a} + {b}?", "solution": f"$\\boxed{{{a + b}}}$"}
        for a, b in pairs])
    write_jsonl(data / "aime24.jsonl", [{"problem": f"What is {a} + 1?", "answer": str(a + 1)}
                                        for a in (1, 2)])
    return ckpt, data, tok


def write_parquet(path, rows) -> str:
    """`rows` (dicts) as a parquet file at `path`, written with pyarrow as verl's
    preprocessing scripts and `datasets.Dataset.to_parquet` write theirs (a dict a
    struct column, a list of dicts a list of structs); returns the path as a string."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(list(rows)), str(path))
    return str(path)


def tiny_checkpoint(path) -> None:
    """The tiny preset's model as a Hugging Face checkpoint in `path` (random weights,
    float32; the SentencePiece tokenizer's special ids)."""
    import jax

    from stablerl_jax import presets
    from stablerl_jax.interop.hf_export import save_qwen3_moe
    from stablerl_jax.model import transformer as tf
    cfg = presets.preset("tiny").model
    save_qwen3_moe(tf.init_params(jax.random.key(3), cfg), cfg, str(path),
                   config_extra={"eos_token_id": 3, "pad_token_id": 0, "bos_token_id": 2})
