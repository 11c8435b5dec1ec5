"""nanosft.collator: padding, labels, padding-free rows, MLM masking, the transformers collators.

Compared: batches against tensors written out in the test (TRL's own docstring examples for the
causal collator) and against rules stated in the test (-100 on padding and on each document's first
token, 80/10/10 over many draws). Negative control: transformers' DataCollatorForLanguageModeling,
whose naive `labels[labels == pad] = -100` rule drops every real EOS when pad id == EOS id, run on
the same examples; ours keeps them. Hermetic: plain integer ids, CPU.
Run: python -m pytest -q tests/test_collator.py
"""

import pytest
import torch

from nanosft.collator import (
    DataCollatorForLanguageModeling,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    default_data_collator,
    pad,
)

T = torch.tensor


def eq(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------- causal LM, padded


def test_right_padding_and_labels_trl_docstring():
    out = DataCollatorForLanguageModeling(pad_token_id=0)(
        [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
    )
    eq(out["input_ids"], T([[1, 2, 3], [4, 5, 0]]))
    eq(out["attention_mask"], T([[1, 1, 1], [1, 1, 0]]))
    eq(out["labels"], T([[1, 2, 3], [4, 5, -100]]))
    examples = [
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
        {"input_ids": [4, 5], "labels": [-100, 5]},
    ]
    eq(
        DataCollatorForLanguageModeling(pad_token_id=0)(examples)["labels"],
        T([[-100, 2, 3], [-100, 5, -100]]),
    )


def test_left_padding_and_multiple_of():
    c = DataCollatorForLanguageModeling(pad_token_id=9, padding_side="left", pad_to_multiple_of=4)
    out = c([{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": [6]}])
    assert out["input_ids"].shape == (2, 8)
    eq(out["input_ids"][1], T([9] * 7 + [6]))
    eq(out["attention_mask"][1], T([0] * 7 + [1]))
    eq(out["labels"][0], T([-100] * 3 + [1, 2, 3, 4, 5]))


def test_eos_stays_supervised_when_pad_is_eos():
    eos = 2
    examples = [{"input_ids": [5, 6, eos]}, {"input_ids": [7, eos, 8, 9, eos]}]
    out = DataCollatorForLanguageModeling(pad_token_id=eos)(examples)
    # Every real EOS is a target; only the two padding slots are -100.
    eq(out["labels"], T([[5, 6, eos, -100, -100], [7, eos, 8, 9, eos]]))
    assert (out["labels"] == eos).sum() == 3


def test_naive_pad_rule_in_transformers_collator_drops_real_eos():
    # Negative control, run through the code that has the classic rule: transformers'
    # DataCollatorForLanguageModeling(mlm=False) sets labels[labels == pad_token_id] = -100, so with
    # pad == EOS every real EOS loses its label; ours (above) keeps all three.
    from tokenizers import Tokenizer as BackendTokenizer
    from tokenizers.models import WordLevel
    from transformers import DataCollatorForLanguageModeling as HFCollator
    from transformers import PreTrainedTokenizerFast

    eos = 2
    vocab = {"<unk>": 0, "<x>": 1, "</s>": eos, **{f"t{i}": i for i in range(3, 10)}}
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=BackendTokenizer(WordLevel(vocab, "<unk>")),
        eos_token="</s>",
        pad_token="</s>",
    )
    examples = [{"input_ids": [5, 6, eos]}, {"input_ids": [7, eos, 8, 9, eos]}]
    theirs = HFCollator(hf_tok, mlm=False)([dict(e) for e in examples])
    ours = DataCollatorForLanguageModeling(pad_token_id=eos)(examples)
    eq(theirs["input_ids"], ours["input_ids"])  # same batch, same padding ...
    assert (theirs["labels"] == eos).sum() == 0  # ... but the naive rule unlabels every real EOS
    assert (ours["labels"] == eos).sum() == 3
    eq(theirs["labels"] == -100, ours["input_ids"] == eos)


def test_completion_mask_applies_only_with_completion_only_loss():
    ex = [{"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1]}]
    eq(DataCollatorForLanguageModeling(0)(ex)["labels"], T([[-100, -100, 3, 4]]))
    eq(
        DataCollatorForLanguageModeling(0, completion_only_loss=False)(ex)["labels"],
        T([[1, 2, 3, 4]]),
    )


def test_caller_labels_are_kept_and_masks_apply_only_without_labels():
    # TRL's collator keeps a row's labels as given; masks build labels only for rows without any
    ex = [{"input_ids": [1, 2, 3, 4], "labels": [-100, 2, 3, 4], "assistant_masks": [1, 1, 0, 1]}]
    eq(DataCollatorForLanguageModeling(0, completion_only_loss=False)(ex)["labels"],
       T([[-100, 2, 3, 4]]))
    ex = [{"input_ids": [1, 2, 3, 4], "assistant_masks": [1, 1, 0, 1]}]
    eq(DataCollatorForLanguageModeling(0, completion_only_loss=False)(ex)["labels"],
       T([[1, 2, -100, 4]]))


# ---------------------------------------------------------------- causal LM, padding-free


def test_padding_free_trl_docstring():
    examples = [
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
        {"input_ids": [4, 5], "labels": [-100, 5]},
    ]
    out = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples)
    assert set(out) == {
        "input_ids",
        "position_ids",
        "labels",
    }  # no attention_mask: it would hide the restarts
    eq(out["input_ids"], T([[1, 2, 3, 4, 5]]))
    eq(out["position_ids"], T([[0, 1, 2, 0, 1]]))
    eq(out["labels"], T([[-100, 2, 3, -100, 5]]))


def test_padding_free_first_token_of_each_document_is_no_target():
    examples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]  # labels default to input_ids
    out = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples)
    eq(out["labels"], T([[-100, 2, 3, -100, 5]]))


def test_padding_free_packed_rows_restart_at_seq_lengths():
    packed = [
        {"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [2, 3]},
        {"input_ids": [6, 7], "seq_lengths": [2]},
    ]
    out = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=4)(
        packed
    )
    eq(out["position_ids"], T([[0, 1, 0, 1, 2, 0, 1, 0]]))
    eq(out["input_ids"], T([[1, 2, 3, 4, 5, 6, 7, 0]]))
    eq(out["labels"], T([[-100, 2, -100, 4, 5, -100, 7, -100]]))


# ---------------------------------------------------------------- masked LM

MASK, VOCAB = 1, 1000


def mlm(**kw):
    return DataCollatorForLanguageModeling(
        pad_token_id=0, mlm=True, mask_token_id=MASK, vocab_size=VOCAB, **kw
    )


def test_mlm_80_10_10_over_many_draws():
    ids = torch.randint(2, VOCAB, (64, 512), generator=torch.Generator().manual_seed(1))
    ids[:, 0] = 0  # pad / special: never picked
    out = mlm(seed=0)([{"input_ids": row.tolist()} for row in ids])
    picked = out["labels"] != -100
    n = picked.sum().item()
    assert not picked[:, 0].any()
    eq(out["labels"][picked], ids[picked])  # the target is the original token
    eq(out["input_ids"][~picked], ids[~picked])  # unpicked tokens are untouched
    # 5-sigma bands of the binomial proportions.
    p = n / ids[:, 1:].numel()
    assert abs(p - 0.15) < 5 * (0.15 * 0.85 / ids[:, 1:].numel()) ** 0.5
    new = out["input_ids"][picked]
    as_mask = (new == MASK).float().mean().item()
    kept = (new == ids[picked]).float().mean().item()
    randomized = 1 - as_mask - kept
    tol = 5 * (0.8 * 0.2 / n) ** 0.5
    assert abs(as_mask - 0.8) < tol and abs(kept - 0.1) < tol and abs(randomized - 0.1) < tol


def test_mlm_mask_only_and_special_tokens_mask():
    ex = [{"input_ids": [5, 6, 7, 8] * 50, "special_tokens_mask": [1, 0, 0, 0] * 50}]
    out = mlm(seed=3, mlm_probability=1.0, mask_replace_prob=1.0, random_replace_prob=0.0)(ex)
    eq(out["input_ids"], T([[5, MASK, MASK, MASK] * 50]))
    eq(out["labels"], T([[-100, 6, 7, 8] * 50]))


def test_mlm_same_seed_same_batch():
    ex = [{"input_ids": list(range(2, 60))}, {"input_ids": list(range(2, 30))}]
    a, b = mlm(seed=7)(ex), mlm(seed=7)(ex)
    eq(a["input_ids"], b["input_ids"])
    eq(a["labels"], b["labels"])


def test_bad_collator_settings():
    with pytest.raises(ValueError, match="mlm=True needs mask_token_id and vocab_size"):
        DataCollatorForLanguageModeling(pad_token_id=0, mlm=True)
    with pytest.raises(ValueError, match="must not exceed 1"):
        mlm(mask_replace_prob=0.8, random_replace_prob=0.3)
    with pytest.raises(ValueError, match="pad_token_id is None"):
        DataCollatorForLanguageModeling(pad_token_id=None)
    with pytest.raises(ValueError, match="padding_side must be 'left' or 'right', got 'middle'"):
        DataCollatorForLanguageModeling(pad_token_id=0, padding_side="middle")([{"input_ids": [1]}])
    with pytest.raises(ValueError, match="empty batch"):
        DataCollatorForLanguageModeling(pad_token_id=0)([])
    with pytest.raises(
        ValueError, match="example 0 of the batch: labels has 2 entries but input_ids has 3"
    ):
        DataCollatorForLanguageModeling(pad_token_id=0)(
            [{"input_ids": [1, 2, 3], "labels": [1, 2]}]
        )
    with pytest.raises(KeyError, match="example 1 of the batch has no 'input_ids'"):
        DataCollatorForLanguageModeling(pad_token_id=0)([{"input_ids": [1]}, {"ids": [2]}])


# ---------------------------------------------------------------- the other collators


def test_pad_helper():
    eq(pad([[1, 2, 3], [4]], 0), T([[1, 2, 3], [4, 0, 0]]))
    eq(pad([[1, 2, 3], [4]], 0, "left", pad_to_multiple_of=4), T([[0, 1, 2, 3], [0, 0, 0, 4]]))


def test_with_padding_pads_inputs_not_labels():
    feats = [{"input_ids": [1, 2, 3], "label": 1}, {"input_ids": [4], "label": 0}]
    out = DataCollatorWithPadding(pad_token_id=0, padding_side="left")(feats)
    eq(out["input_ids"], T([[1, 2, 3], [0, 0, 4]]))
    eq(out["attention_mask"], T([[1, 1, 1], [0, 0, 1]]))
    eq(out["labels"], T([1, 0]))
    assert "label" not in out


def test_token_classification_pads_labels_with_minus_100():
    feats = [{"input_ids": [1, 2, 3], "labels": [0, 1, 2]}, {"input_ids": [4], "labels": [3]}]
    right = DataCollatorForTokenClassification(pad_token_id=0, pad_to_multiple_of=4)(feats)
    eq(right["labels"], T([[0, 1, 2, -100], [3, -100, -100, -100]]))
    left = DataCollatorForTokenClassification(pad_token_id=0, padding_side="left")(feats)
    eq(left["labels"], T([[0, 1, 2], [-100, -100, 3]]))
    eq(left["input_ids"], T([[1, 2, 3], [0, 0, 4]]))


def test_default_data_collator_label_types():
    out = default_data_collator([{"x": [1, 2], "label": 1}, {"x": [3, 4], "label": 0}])
    assert out["labels"].dtype == torch.long and out["x"].shape == (2, 2)
    assert default_data_collator([{"label": 0.5}, {"label": 1.5}])["labels"].dtype == torch.float
    eq(
        default_data_collator([{"label_ids": [1, 2]}, {"label_ids": [3, 4]}])["labels"],
        T([[1, 2], [3, 4]]),
    )
    assert "name" not in default_data_collator([{"name": "a", "x": 1}])
