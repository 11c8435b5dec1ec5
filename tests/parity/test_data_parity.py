"""Parity of nanosft.data / nanosft.collator with TRL 1.16 SFT preparation and transformers
collators.

Compared, exactly (integers, atol=0): for the same examples, `SFTTrainer(...).train_dataset` rows
(input_ids, labels, seq_lengths) against `nanosft.data.prepare_dataset`, for plain text,
prompt-completion (strings and messages), conversations (with and without assistant_only_loss) and
BFD packing over 2,500 rows (three 1000-example map batches); then batches from TRL's collator
(padded and padding-free) against ours; then transformers' DataCollatorWithPadding,
DataCollatorForTokenClassification, default_data_collator and the MLM collator under the same seed.
Hermetic: a byte-level BPE trained here, saved, and read back by AutoTokenizer; a 1-layer
LlamaForCausalLM built from a config (SFTTrainer needs a model; it never runs). CPU, no network.
Run: python -m pytest -q tests/parity/test_data_parity.py
"""

import random
import types

import datasets
import pytest
import torch

from nanosft import collator as nc
from nanosft.data import prepare_dataset
from nanosft.tokenizer import Tokenizer

CORPUS = [
    "the cat sat on the mat.",
    "hello world, what is two plus two? four.",
    "be nice and brief.",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<mask>"]
CHAT = [
    {"role": "system", "content": "be nice"},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hello world"},
    {"role": "user", "content": "two plus two?"},
    {"role": "assistant", "content": "four."},
]
PLAIN_CHATML = (  # the built-in ChatML minus its {% generation %} tags
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' "
    "+ message['content'] + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    folder = str(tmp_path_factory.mktemp("tok"))
    Tokenizer.train(CORPUS * 10, vocab_size=320, special_tokens=SPECIALS).save_pretrained(folder)
    hf = AutoTokenizer.from_pretrained(folder)
    hf.mask_token = "<mask>"
    return types.SimpleNamespace(dir=folder, hf=hf, tok=Tokenizer.from_pretrained(folder))


def trl_prepare(ref, examples, **config):
    """TRL's own path: SFTTrainer.__init__ (format decisions) -> _prepare_dataset -> dataset."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(ref.hf),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    args = SFTConfig(
        output_dir=ref.dir, report_to="none", use_cpu=True, bf16=False, max_steps=1, **config
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        processing_class=ref.hf,
        train_dataset=datasets.Dataset.from_list(examples),
    )
    keep = ("input_ids", "labels", "seq_lengths")
    return [
        {k: row[k] for k in keep if k in row} for row in trainer.train_dataset
    ], trainer.data_collator


def assert_batches_equal(ours, theirs, keys):
    for key in keys:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=key)


def assert_collators_agree(ref, rows):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling as TrlCollator

    pad_id = ref.hf.pad_token_id
    for multiple in (None, 8):
        theirs = TrlCollator(pad_token_id=pad_id, pad_to_multiple_of=multiple)(rows)
        ours = nc.DataCollatorForLanguageModeling(pad_token_id=pad_id, pad_to_multiple_of=multiple)(
            rows
        )
        assert_batches_equal(ours, theirs, ("input_ids", "attention_mask", "labels"))
        theirs = TrlCollator(pad_token_id=pad_id, padding_free=True, pad_to_multiple_of=multiple)(
            rows
        )
        ours = nc.DataCollatorForLanguageModeling(
            pad_token_id=pad_id, padding_free=True, pad_to_multiple_of=multiple
        )(rows)
        assert_batches_equal(ours, theirs, ("input_ids", "position_ids", "labels"))


# ---------------------------------------------------------------- SFT dataset preparation


def test_plain_text_truncated(ref):
    examples = [{"text": t} for t in CORPUS] + [{"text": "the cat<|im_end|>"}]
    theirs, _ = trl_prepare(ref, examples, max_length=12)
    ours = prepare_dataset(examples, ref.tok, max_length=12)
    assert ours == theirs
    assert_collators_agree(ref, ours)


def test_prompt_completion_and_fully_masked_drop(ref):
    examples = [
        {"prompt": "what is two plus two?", "completion": " four."},
        {
            "prompt": "the cat sat on the mat. " * 3,
            "completion": " be nice.",
        },  # prompt fills max_length
        {"prompt": "hello", "completion": " world"},
        {"prompt": "the cat ", "completion": "sat on the mat."},
    ]  # space merges across
    theirs, _ = trl_prepare(ref, examples, max_length=16)
    ours = prepare_dataset(examples, ref.tok, max_length=16)
    assert len(theirs) == 3 and ours == theirs
    assert_collators_agree(ref, ours)
    theirs, _ = trl_prepare(ref, examples, completion_only_loss=False)
    assert prepare_dataset(examples, ref.tok, completion_only_loss=False) == theirs


def test_conversational(ref):
    examples = [{"messages": CHAT}, {"messages": CHAT[1:3]}]
    theirs, _ = trl_prepare(ref, examples)
    ours = prepare_dataset(examples, ref.tok)
    assert ours == theirs
    assert_collators_agree(ref, ours)


def test_assistant_only_loss_masks(ref):
    examples = [{"messages": CHAT}, {"messages": CHAT[1:3]}, {"messages": CHAT[:3]}]
    # TRL keeps our template (it has {% generation %} tags) and maps its spans with char_to_token.
    theirs, _ = trl_prepare(ref, examples, assistant_only_loss=True)
    # nanosft finds the same spans by rendering prefixes, even from a template without the tags.
    plain = Tokenizer.from_pretrained(ref.dir)
    plain.chat_template = PLAIN_CHATML
    ours = prepare_dataset(examples, plain, assistant_only_loss=True)
    assert ours == theirs
    assert any(label == -100 for label in ours[0]["labels"])  # the mask did something


def test_conversational_prompt_completion(ref):
    examples = [
        {"prompt": CHAT[:2], "completion": CHAT[2:3]},
        {"prompt": CHAT[:4], "completion": CHAT[4:]},
    ]
    theirs, _ = trl_prepare(ref, examples)
    assert prepare_dataset(examples, ref.tok) == theirs
    theirs, _ = trl_prepare(ref, examples, assistant_only_loss=True, completion_only_loss=False)
    ours = prepare_dataset(examples, ref.tok, assistant_only_loss=True, completion_only_loss=False)
    assert ours == theirs


def test_bfd_packing_over_several_map_batches(ref):
    rng = random.Random(0)
    examples = []
    for _ in range(2500):  # many equal lengths: tie order matters
        ids = [rng.randrange(4, 300) for _ in range(rng.randint(1, 48))]
        examples.append(
            {"input_ids": ids, "labels": [i if rng.random() < 0.7 else -100 for i in ids]}
        )
    for strategy in ("bfd", "bfd_split"):
        theirs, trl_collator = trl_prepare(
            ref, examples, packing=True, packing_strategy=strategy, max_length=40
        )
        ours = prepare_dataset(
            examples, ref.tok, packing=True, packing_strategy=strategy, max_length=40
        )
        assert len(ours) == len(theirs) and ours == theirs
    # BFD packing makes TRL collate padding-free; its batches equal ours.
    assert trl_collator.padding_free
    ours_collator = nc.DataCollatorForLanguageModeling(ref.hf.pad_token_id, padding_free=True)
    assert_batches_equal(
        ours_collator(ours[:8]), trl_collator(theirs[:8]), ("input_ids", "position_ids", "labels")
    )


def test_text_packing(ref):
    examples = [{"text": " ".join(CORPUS[: 1 + k % 3] * (1 + k % 4))} for k in range(12)]
    theirs, _ = trl_prepare(ref, examples, packing=True, max_length=48)
    assert prepare_dataset(examples, ref.tok, packing=True, max_length=48) == theirs


# ---------------------------------------------------------------- transformers collators


def features():
    return [{"input_ids": [5, 6, 7, 8, 9], "label": 1}, {"input_ids": [10, 11], "label": 0}]


@pytest.mark.parametrize("side", ["right", "left"])
def test_with_padding_and_token_classification(ref, side):
    from transformers import DataCollatorForTokenClassification, DataCollatorWithPadding

    hf = ref.hf
    hf.padding_side = side
    try:
        theirs = DataCollatorWithPadding(hf, pad_to_multiple_of=4)(features())
        ours = nc.DataCollatorWithPadding(hf.pad_token_id, padding_side=side, pad_to_multiple_of=4)(
            features()
        )
        assert set(ours) == set(theirs)
        assert_batches_equal(ours, theirs, theirs.keys())
        tagged = [
            {"input_ids": f["input_ids"], "labels": list(range(len(f["input_ids"])))}
            for f in features()
        ]
        theirs = DataCollatorForTokenClassification(hf, pad_to_multiple_of=4)(tagged)
        ours = nc.DataCollatorForTokenClassification(
            hf.pad_token_id, padding_side=side, pad_to_multiple_of=4
        )(tagged)
        assert set(ours) == set(theirs)
        assert_batches_equal(ours, theirs, theirs.keys())
    finally:
        hf.padding_side = "right"


def test_default_data_collator(ref):
    from transformers import default_data_collator

    feats = [
        {"input_ids": [1, 2], "label": 1, "name": "a"},
        {"input_ids": [3, 4], "label": 0, "name": "b"},
    ]
    theirs, ours = default_data_collator(feats), nc.default_data_collator(feats)
    assert set(ours) == set(theirs)
    assert_batches_equal(ours, theirs, theirs.keys())
    assert ours["labels"].dtype == theirs["labels"].dtype


def test_causal_lm_collator_and_the_pad_eos_divergence(ref):
    from transformers import DataCollatorForLanguageModeling

    hf = ref.hf
    rows = [{"input_ids": [5, 6, 7, 8]}, {"input_ids": [9, 10]}]
    theirs = DataCollatorForLanguageModeling(hf, mlm=False)(rows)
    ours = nc.DataCollatorForLanguageModeling(hf.pad_token_id)(rows)
    assert_batches_equal(ours, theirs, ("input_ids", "attention_mask", "labels"))
    # With pad id == a real token (here the EOS), transformers' rule masks the real one too; ours
    # keeps it.
    eos_rows = [{"input_ids": [5, hf.pad_token_id]}, {"input_ids": [9]}]
    theirs = DataCollatorForLanguageModeling(hf, mlm=False)(eos_rows)
    ours = nc.DataCollatorForLanguageModeling(hf.pad_token_id)(eos_rows)
    assert theirs["labels"][0, 1] == -100 and ours["labels"][0, 1] == hf.pad_token_id


@pytest.mark.parametrize("seed", [None, 5])
def test_mlm_same_rng_same_batch(ref, seed):
    from transformers import DataCollatorForLanguageModeling

    hf = ref.hf
    rows = [
        {"input_ids": list(range(3, 60))},
        {"input_ids": list(range(5, 30))},
        {"input_ids": [2, 7, 8]},
    ]
    ours_collator = nc.DataCollatorForLanguageModeling(
        hf.pad_token_id,
        mlm=True,
        mask_token_id=hf.mask_token_id,
        vocab_size=len(hf),
        seed=seed,
        special_token_ids=tuple(hf.all_special_ids),
    )
    theirs_collator = DataCollatorForLanguageModeling(hf, mlm=True, seed=seed)
    for _ in range(3):  # a seeded generator carries over between calls
        torch.manual_seed(0)
        theirs = theirs_collator(rows)
        torch.manual_seed(0)
        ours = ours_collator(rows)
        assert_batches_equal(ours, theirs, ("input_ids", "attention_mask", "labels"))
    assert (ours["input_ids"] == hf.mask_token_id).any()
