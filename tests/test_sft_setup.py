"""SFTTrainer.__init__ reads as TRL's set-up steps: one call per step before the printed
`super().__init__(` and a few after it, with no branch or refusal inline (those live in
nanosft/run/sft_setup.py, imported inside the method, so `import nanosft.sft` loads none of them).

Compared: the statements of SFTTrainer.__init__, read with ast, against that shape; a negative
control shows the reader of statements finds an inline check. The checks' behaviour and messages
are tested where they were before (test_trl_construction, test_dataset_inputs, test_hostile_*).
Hermetic, no model built, well under a second.
Run: python -m pytest -q tests/test_sft_setup.py
"""

import ast
import inspect
import textwrap

from nanosft import sft

# statements a step may be: a call, or a name bound to a call's result (plus the import of the
# product-layer helpers and the dict of keywords the printed call passes as **super_init_kwargs)
STEP = (ast.Expr, ast.Assign, ast.ImportFrom)
MAX_BEFORE_SUPER = 11  # import + Args, 2 checks, seed, Model, PEFT, rows, collator, Dataset, kwargs
MAX_AFTER_SUPER = 6


def is_super_init(statement):
    call = getattr(statement, "value", None)
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
            and call.func.attr == "__init__" and isinstance(call.func.value, ast.Call)
            and getattr(call.func.value.func, "id", None) == "super")


def not_a_step(statement):
    """Why `statement` is not one named step, or None."""
    if not isinstance(statement, STEP):
        return f"line {statement.lineno}: {type(statement).__name__}"
    value = getattr(statement, "value", None)
    if isinstance(statement, ast.Assign) and not isinstance(value, (ast.Call, ast.Dict,
                                                                   ast.Constant)):
        return f"line {statement.lineno}: assigns {type(value).__name__}"
    if isinstance(statement, ast.Expr) and not isinstance(value, ast.Call):
        return f"line {statement.lineno}: {type(value).__name__}"
    return None


def steps_of(source):
    """(statements before super().__init__, after it, the ones that are not a step)."""
    function = ast.parse(textwrap.dedent(source)).body[0]
    body = function.body
    at = next(i for i, statement in enumerate(body) if is_super_init(statement))
    before, after = body[:at], body[at + 1:]
    return before, after, [why for s in before + after if (why := not_a_step(s))]


def test_sft_init_is_one_call_per_trl_step():
    before, after, offending = steps_of(inspect.getsource(sft.SFTTrainer.__init__))
    assert offending == []
    assert len(before) <= MAX_BEFORE_SUPER
    assert len(after) <= MAX_AFTER_SUPER
    # the steps are named after TRL's: each one is called from __init__
    source = inspect.getsource(sft.SFTTrainer.__init__)
    for step in ("_as_sft_config", "create_model", "_prepare_peft_model", "_create_data_collator",
                 "_prepare_datasets", "_set_signature_columns_if_needed", "router_aux_loss",
                 "add_model_tags"):
        assert f"{step}(" in source, step


def test_the_reader_of_steps_sees_an_inline_check():
    # negative control: an `if ...: raise` before the printed call is not a step
    source = '''
    def __init__(self, model, args=None):
        args = make(args)
        if args is None:
            raise ValueError("no args")
        super().__init__(model=model, args=args)
        self.x = 0
    '''
    before, after, offending = steps_of(source)
    assert len(before) == 2 and len(after) == 1
    assert offending == ["line 4: If"]
