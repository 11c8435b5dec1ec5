"""Byte-level BPE tokenizer over the `tokenizers` library, plus chat-template rendering.

Train a tiny tokenizer, load / save a Hugging Face tokenizer folder (tokenizer.json,
tokenizer_config.json, chat_template.jinja) that transformers' AutoTokenizer reads back with the
same ids, and render chats: a built-in ChatML renderer in plain Python, or a folder's own Jinja
template. SFTTrainer.__init__ takes it as `processing_class`, for TRL
SFTTrainer._prepare_dataset's tokenization; the files as transformers 5 writes them. Scripts call
it as transformers' fast tokenizer (`tokenizer(texts, padding=True, return_tensors="pt")`,
`pad_token = eos_token`, `batch_decode`, `apply_chat_template(..., tools=...)`), with equal ids.
"""

import json
import os
import re
from datetime import datetime
from functools import lru_cache

from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer

DEFAULT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_ROLES = ("system", "user", "assistant", "tool")
VERY_LARGE_INTEGER = int(1e30)  # transformers' "no limit" model_max_length
LARGE_INTEGER = int(1e20)  # above it, model_max_length means no limit
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")

# The built-in ChatML as Jinja, written to chat_template.jinja. `{% generation %}` marks the
# assistant's trained span (content + "<|im_end|>\n"), so transformers' return_assistant_tokens_mask
# and TRL's assistant_only_loss work on a saved folder without swapping templates.
CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}\n"
    "{%- if message['role'] == 'assistant' %}\n"
    "{%- generation %}\n"
    "{{- message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endgeneration %}\n"
    "{%- else %}\n"
    "{{- message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def validate_messages(messages):
    """Check a chat is a non-empty list of {"role", "content": str} dicts; an assistant message
    with `tool_calls` may have no content (None keys count as absent). Errors name index and field.
    Mirrors: transformers apply_chat_template input checks | Differs: stricter."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {messages!r:.80}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', "
                            f"got {message!r:.80}")
        if message.get("role") not in CHAT_ROLES:
            sharegpt = (" (ShareGPT's 'human' / 'gpt': map them to 'user' / 'assistant')"
                        if message.get("role") in ("human", "gpt") else "")
            raise ValueError(f"messages[{i}]['role'] is {message.get('role')!r}; "
                             f"expected one of {CHAT_ROLES}{sharegpt}")
        content = message.get("content")
        if content is None and message.get("tool_calls") is not None:
            continue  # a tool call without text: the template renders the calls
        if not isinstance(content, str):
            fix = ("give it a string content, or tool_calls (an assistant's function calls)"
                   if content is None else "join multi-part content into one string")
            raise TypeError(f"messages[{i}]['content'] must be a str, "
                            f"got {type(content).__name__} (fix: {fix})")


def render_chatml(messages, add_generation_prompt=False):
    """Render ChatML in plain Python; returns (text, assistant_spans) with char spans [start, end).
    Mirrors: the Jinja CHATML_TEMPLATE rendered by transformers render_jinja_template."""
    validate_messages(messages)
    for i, message in enumerate(messages):
        if not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}] has tool_calls and no content, which the built-in "
                             "ChatML template cannot render; fix: set a chat template that renders "
                             "tool calls (the model's own chat_template.jinja, or "
                             "SFTConfig(chat_template_path=...))")
    text, spans = "", []
    for message in messages:
        text += f"<|im_start|>{message['role']}\n"
        body = f"{message['content']}<|im_end|>\n"
        if message["role"] == "assistant":  # the {% generation %} span of CHATML_TEMPLATE
            spans.append((len(text), len(text) + len(body)))
        text += body
    if add_generation_prompt:
        text += "<|im_start|>assistant\n"
    return text, spans


# Private-use characters framing {% generation %} output while rendering; removed afterwards.
_GEN_START, _GEN_END = "\ue000", "\ue001"


@lru_cache(maxsize=16)
def _compile_jinja_template(template):
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as error:
        raise ImportError("rendering a Jinja chat template needs jinja2: `pip install jinja2` "
                          "(or set tokenizer.chat_template = nanosft.tokenizer.CHATML_TEMPLATE "
                          "for the built-in)") from error

    # {% generation %}...{% endgeneration %}, as transformers' AssistantTracker
    class GenerationTag(Extension):
        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            block = jinja2.nodes.CallBlock(self.call_method("_frame"), [], [], body)
            return block.set_lineno(lineno)

        def _frame(self, caller):
            return _GEN_START + caller() + _GEN_END

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    # trim_blocks / lstrip_blocks and the helpers below are what transformers gives templates.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _jinja_syntax_errors():
    # evaluated only when an exception is raised; jinja2 is optional (the install hint wins).
    # What the template's own code raises at render time (raise_exception) stays a TemplateError,
    # as in transformers.
    try:
        from jinja2 import TemplateSyntaxError
    except ImportError:
        return ()
    return (TemplateSyntaxError,)


def render_jinja_template(template, messages, add_generation_prompt=False, tools=None,
                          documents=None, **special_tokens):
    """Render a Jinja chat template; returns (text, spans of its {% generation %} blocks).
    `tools` (JSON schemas) and `documents` are template variables, as transformers passes them.
    Mirrors: transformers render_jinja_template, _render_with_assistant_indices."""
    validate_messages(messages)
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # as transformers
    if any(_GEN_START in m.get("content", "") or _GEN_END in m.get("content", "")
           for m in messages):
        raise ValueError("message content contains U+E000/U+E001, "
                         "reserved for {% generation %} tracking")
    for i, tool in enumerate(tools or ()):
        if not isinstance(tool, dict):
            raise TypeError(f"tools[{i}] is a {type(tool).__name__}; nanosft takes tools as JSON "
                            "schemas (dicts); fix: pass transformers.utils.get_json_schema(fn) "
                            "for a function")
    try:
        framed = _compile_jinja_template(template).render(
            messages=messages, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, **special_tokens)
    except _jinja_syntax_errors() as error:  # a syntax error, an unknown filter or test
        line = getattr(error, "lineno", None)
        where = f" (line {line})" if line else ""
        reason = str(error.message).rstrip(".")
        raise ValueError(f"the chat template cannot be rendered{where}: {reason}; fix the "
                         "template (chat_template.jinja)") from None
    text, spans, starts = "", [], []
    for piece in re.split(f"([{_GEN_START}{_GEN_END}])", framed):
        if piece == _GEN_START:
            starts.append(len(text))
        elif piece == _GEN_END:
            spans.append((starts.pop(), len(text)))
        else:
            text += piece
    return text, spans


def _read_json(path):
    """Parse a JSON file; a corrupt file raises naming the file, line and column."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        return json.loads(text), text
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON (line {error.lineno}, column {error.colno}: "
                         f"{error.msg}); fix or re-save the file, e.g. with "
                         "Tokenizer.save_pretrained") from None


def _token_content(value):
    # tokenizer_config.json spells special tokens as "<s>" or as {"content": "<s>", ...}.
    return value.get("content") if isinstance(value, dict) else value


def _write_files_atomically(folder, files):
    """Write every {name: text} to a temp file first, then os.replace each into place."""
    os.makedirs(folder, exist_ok=True)
    temps = []
    for name, text in files.items():
        temp = os.path.join(folder, f".{name}.tmp{os.getpid()}")
        with open(temp, "w", encoding="utf-8") as f:
            f.write(text)
        temps.append((temp, os.path.join(folder, name)))
    for temp, final in temps:
        os.replace(temp, final)


def _add_missing_added_tokens(backend, added_tokens_decoder, config_file):
    """Add tokenizer_config.json's added_tokens_decoder entries absent from tokenizer.json,
    checking ids."""
    for index, entry in sorted(added_tokens_decoder.items(), key=lambda item: int(item[0])):
        content = _token_content(entry)
        if backend.token_to_id(content) is None and int(index) == backend.get_vocab_size():
            special = entry.get("special", True) if isinstance(entry, dict) else True
            backend.add_tokens([AddedToken(content, special=special, normalized=not special)])
        if backend.token_to_id(content) != int(index):
            raise ValueError(f"{config_file}: added_tokens_decoder[{index!r}] is {content!r}, "
                             f"but tokenizer.json gives it id {backend.token_to_id(content)}; "
                             "fix: make the two files agree")


def _read_chat_template(folder, config):
    """chat_template.jinja wins; else the legacy "chat_template" key of tokenizer_config.json."""
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # legacy named templates: [{"name": "default", "template": ...}]
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    return template


def _special_token_property(key, as_id=False):
    """A named special token (its string, or its id with as_id), settable as in transformers:
    `tokenizer.pad_token = tokenizer.eos_token`, `tokenizer.pad_token_id = 0`."""
    def get(self):
        token = self._special[key]
        return self.backend.token_to_id(token) if as_id and token is not None else token

    def set(self, value):
        if as_id:
            token = None if value is None else self.backend.id_to_token(int(value))
            if value is not None and token is None:
                raise ValueError(f"{key}_id = {value}: no token has that id (the vocabulary has "
                                 f"{len(self)}); fix: give an id below {len(self)}")
        else:
            token = _token_content(value) if isinstance(value, dict) else value
            token = getattr(token, "content", token)  # a tokenizers.AddedToken
        if token is not None and self.backend.token_to_id(token) is None:
            raise ValueError(f"{key} = {token!r}: not in the vocabulary, so it has no id; fix: "
                             "use a token the tokenizer has (tokenizer.eos_token works for "
                             "pad_token)")
        self._special[key] = token

    name = key + "_id" if as_id else key
    return property(get, set, doc=f"The {name} (None when unset). Mirrors: transformers {name}")


class BatchEncoding(dict):
    """The tokenizer's output: a dict (input_ids, attention_mask, ...) also read as attributes.
    Mirrors: transformers BatchEncoding (dict access, `.input_ids`, `.to(device)`)"""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to(self, device):
        """Move every tensor value to `device` (others stay)."""
        return BatchEncoding({k: v.to(device) if hasattr(v, "to") else v for k, v in self.items()})


def _padding_strategy(padding):
    """transformers' PaddingStrategy names: True -> "longest", False -> "do_not_pad"."""
    strategy = {True: "longest", False: "do_not_pad", None: "do_not_pad"}.get(padding, padding)
    if strategy not in ("longest", "max_length", "do_not_pad"):
        raise ValueError(f"padding={padding!r}: expected True, False, 'longest', 'max_length' or "
                         "'do_not_pad'")
    return strategy


def _truncation_strategy(truncation):
    strategy = {True: "longest_first", False: "do_not_truncate", None: "do_not_truncate"}.get(
        truncation, truncation)
    if strategy not in ("longest_first", "only_first", "only_second", "do_not_truncate"):
        raise ValueError(f"truncation={truncation!r}: expected True, False, 'longest_first', "
                         "'only_first', 'only_second' or 'do_not_truncate'")
    return strategy


def _as_tensors(batch, return_tensors):
    if return_tensors is None:
        return batch
    if return_tensors != "pt":
        raise ValueError(f"return_tensors={return_tensors!r}: nanosft returns PyTorch tensors "
                         "only; fix: return_tensors='pt' (or None for lists)")
    import torch  # only when tensors are asked for

    for key, rows in batch.items():
        if len({len(row) for row in rows}) > 1:
            raise ValueError(f"return_tensors='pt' needs rows of one length, but {key} has "
                             f"lengths {sorted({len(r) for r in rows})}; fix: padding=True "
                             "(or truncation=True with max_length)")
        batch[key] = torch.tensor(rows, dtype=torch.long)
    return batch


class Tokenizer:
    """A `tokenizers.Tokenizer` plus named special tokens and a chat template, HF-folder compatible.
    Mirrors: transformers TokenizersBackend (PreTrainedTokenizerFast)
    Differs: a special token missing from the vocabulary is an error, never silently appended."""

    def __init__(self, backend, *, bos_token=None, eos_token=None, pad_token=None, unk_token=None,
                 chat_template=None, model_max_length=VERY_LARGE_INTEGER, source="Tokenizer(...)",
                 padding_side="right", truncation_side="right"):
        self.backend = backend
        self.chat_template = chat_template
        self.padding_side = padding_side  # where __call__(padding=...) puts pad tokens
        self.truncation_side = truncation_side
        self.name_or_path = os.path.dirname(source) if source.endswith(".json") else source
        self.model_max_length = model_max_length
        self._special = {"bos_token": bos_token, "eos_token": eos_token,
                         "unk_token": unk_token, "pad_token": pad_token}
        for key, token in self._special.items():
            if token is not None and backend.token_to_id(token) is None:
                raise ValueError(f"{source}: {key} {token!r} is not in the vocabulary; fix: add it "
                                 f"to tokenizer.json's added_tokens or set {key} to an existing "
                                 "token")

    @classmethod
    def train(cls, texts, vocab_size, special_tokens=None, *, pad_token="<|endoftext|>",
              eos_token="<|im_end|>", bos_token=None):
        """Train a byte-level BPE (GPT-2 style, no BOS unless bos_token is given) on strings.
        Mirrors: tokenizers BpeTrainer with pre_tokenizers.ByteLevel
        (GPT-2 / Qwen family)
        Ids: special tokens first (in order), then the 256 byte symbols, then merges.
        Deterministic."""
        specials = list(special_tokens if special_tokens is not None else DEFAULT_SPECIAL_TOKENS)
        specials += [t for t in (pad_token, eos_token, bos_token)
                     if t is not None and t not in specials]
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"texts[{i}] must be a str, got {type(text).__name__}")
        # all 256 bytes: any unicode text round-trips
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(alphabet) + len(specials):
            raise ValueError(f"vocab_size={vocab_size} is below {len(alphabet)} byte symbols + "
                             f"{len(specials)} special tokens; "
                             f"fix: vocab_size >= {len(alphabet) + len(specials)}")
        backend = BackendTokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                      initial_alphabet=alphabet, show_progress=False)
        backend.train_from_iterator(texts, trainer)
        # A TemplateProcessing post-processor, as transformers writes; it adds BOS only when asked.
        single = f"{bos_token} $A" if bos_token else "$A"
        backend.post_processor = processors.TemplateProcessing(
            single=single, pair=f"{single} $B:1",
            special_tokens=[(bos_token, backend.token_to_id(bos_token))] if bos_token else [])
        return cls(backend, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token,
                   chat_template=CHATML_TEMPLATE)

    @classmethod
    def from_pretrained(cls, folder):
        """Load a Hugging Face tokenizer folder: tokenizer.json, tokenizer_config.json and
        chat_template.jinja.
        Mirrors: transformers AutoTokenizer.from_pretrained -> TokenizersBackend
        Differs: local folders only; no slow-tokenizer conversion, no special_tokens_map.json."""
        tokenizer_file = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(
                f"{tokenizer_file} not found; nanosft reads only the fast-tokenizer file. "
                "Fix: point at a Hugging Face tokenizer folder, or convert one with transformers: "
                "AutoTokenizer.from_pretrained(dir).save_pretrained(dir)")
        _, text = _read_json(tokenizer_file)
        try:
            backend = BackendTokenizer.from_str(text)
        except Exception as error:  # noqa: BLE001 (tokenizers raises a bare Exception)
            raise ValueError(f"{tokenizer_file}: the tokenizers library cannot read it ({error}); "
                             "fix: re-save it with tokenizers >= 0.19") from None
        config_file = os.path.join(folder, "tokenizer_config.json")
        config = _read_json(config_file)[0] if os.path.isfile(config_file) else {}
        _add_missing_added_tokens(backend, config.get("added_tokens_decoder", {}), config_file)
        # BOS/EOS insertion stays as tokenizer.json's post-processor says: transformers 5 drops the
        # config's add_bos_token / add_eos_token whenever tokenizer.json exists.
        special = {key: _token_content(config.get(key)) for key in SPECIAL_TOKEN_KEYS}
        return cls(backend, **special, chat_template=_read_chat_template(folder, config),
                   model_max_length=config.get("model_max_length", VERY_LARGE_INTEGER),
                   source=config_file, padding_side=config.get("padding_side", "right"),
                   truncation_side=config.get("truncation_side", "right"))

    def save_pretrained(self, folder):
        """Atomically write tokenizer.json, tokenizer_config.json (v5 layout) and
        chat_template.jinja.
        Mirrors: transformers PreTrainedTokenizerBase.save_pretrained"""
        config = {"backend": "tokenizers"}
        config.update({key: token for key, token in self._special.items() if token is not None})
        config.update(model_max_length=self.model_max_length, tokenizer_class="TokenizersBackend")
        files = {"tokenizer.json": self.backend.to_str(pretty=True),
                 "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n"}
        if self.chat_template is not None:
            files["chat_template.jinja"] = self.chat_template
        _write_files_atomically(folder, files)
        return sorted(os.path.join(folder, name) for name in files)

    # ---- vocabulary and special tokens -------------------------------------------------------
    def __len__(self):
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self):
        """Base vocabulary size without added tokens, as transformers' `vocab_size`
        (len() counts them).
        Mirrors: transformers PreTrainedTokenizerFast.vocab_size"""
        return self.backend.get_vocab_size(with_added_tokens=False)

    def token_to_id(self, token):
        """Token string -> id, or None.
        Mirrors: transformers convert_tokens_to_ids"""
        return self.backend.token_to_id(token)

    def id_to_token(self, index):
        """Id -> token string, or None.
        Mirrors: transformers convert_ids_to_tokens"""
        return self.backend.id_to_token(index)

    def convert_tokens_to_ids(self, tokens):
        """A token or a list of tokens -> id(s); None for a token not in the vocabulary.
        Mirrors: transformers convert_tokens_to_ids"""
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(token) for token in tokens]

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
        """An id or a list of ids -> token(s).
        Mirrors: transformers convert_ids_to_tokens"""
        if isinstance(ids, int) or getattr(ids, "ndim", 1) == 0:
            return self.backend.id_to_token(int(ids))
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.backend.id_to_token(int(i)) for i in ids if int(i) not in special]

    def get_vocab(self):
        """{token: id} including added tokens. Mirrors: transformers get_vocab"""
        return self.backend.get_vocab(with_added_tokens=True)

    @property
    def special_tokens_map(self):
        """{"bos_token": ..., ...} for the special tokens that are set.
        Mirrors: transformers special_tokens_map"""
        return {key: token for key, token in self._special.items() if token is not None}

    @property
    def all_special_ids(self):
        """Ids of the added tokens marked special. Mirrors: transformers all_special_ids"""
        return sorted(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    bos_token = _special_token_property("bos_token")
    eos_token = _special_token_property("eos_token")
    pad_token = _special_token_property("pad_token")
    unk_token = _special_token_property("unk_token")
    bos_token_id = _special_token_property("bos_token", as_id=True)
    eos_token_id = _special_token_property("eos_token", as_id=True)
    pad_token_id = _special_token_property("pad_token", as_id=True)
    unk_token_id = _special_token_property("unk_token", as_id=True)

    # ---- text <-> ids -----------------------------------------------------------------------
    def encode(self, text, add_special_tokens=True):
        """Text -> token ids; special-token strings in the text become their single ids.
        Mirrors: transformers tokenizer(text)["input_ids"]"""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(self, text, add_special_tokens=False):
        """Text -> (ids, offsets): offsets[i] = (start, end) char span of token i in `text`.
        Mirrors: transformers return_offsets_mapping=True (what char_to_token reads)"""
        encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return encoding.ids, encoding.offsets

    def decode(self, ids, skip_special_tokens=False, **kwargs):
        """Token ids (a list, a 1-D tensor or one int) -> text.
        Mirrors: transformers tokenizer.decode"""
        if isinstance(ids, int) or getattr(ids, "ndim", 1) == 0:
            ids = [int(ids)]
        ids = ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens=False, **kwargs):
        """Each row of ids (lists or a (B, T) tensor) -> its text.
        Mirrors: transformers batch_decode"""
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    def __call__(self, text, text_pair=None, add_special_tokens=True, padding=False,
                 truncation=None, max_length=None, pad_to_multiple_of=None, padding_side=None,
                 return_tensors=None, return_attention_mask=None, return_offsets_mapping=False,
                 **kwargs):
        """Tokenize one text or a batch: BatchEncoding(input_ids, attention_mask), padded with
        pad_token_id on padding_side and truncated (special tokens included) as asked; a single
        text gives flat lists, or (1, T) tensors with return_tensors="pt".
        Mirrors: transformers TokenizersBackend.__call__ (_get_padding_truncation_strategies,
        set_truncation_and_padding, _encode_plus)"""
        unknown = set(kwargs) - {"verbose", "return_token_type_ids", "stride"}
        if unknown:
            raise TypeError(f"Tokenizer.__call__ got unsupported arguments {sorted(unknown)}; "
                            "it takes text, text_pair, add_special_tokens, padding, truncation, "
                            "max_length, pad_to_multiple_of, padding_side, return_tensors, "
                            "return_attention_mask, return_offsets_mapping")
        batched = isinstance(text, (list, tuple))
        texts = list(text) if batched else [text]
        for i, item in enumerate(texts):
            if not isinstance(item, str):
                raise TypeError(f"text{f'[{i}]' if batched else ''} must be a str, got "
                                f"{type(item).__name__}; fix: pass a string or a list of strings")
        if text_pair is not None:
            pairs = list(text_pair) if batched else [text_pair]
            texts = list(zip(texts, pairs, strict=True))
        if max_length is not None and padding is False and truncation is None:
            truncation = True  # transformers: max_length alone turns truncation on
        pad_as, cut_as = _padding_strategy(padding), _truncation_strategy(truncation)
        if max_length is None:  # model_max_length, unless it is transformers' "no limit"
            if self.model_max_length > LARGE_INTEGER:
                pad_as = "do_not_pad" if pad_as == "max_length" else pad_as
                cut_as = "do_not_truncate"
            elif pad_as == "max_length" or cut_as != "do_not_truncate":
                max_length = self.model_max_length
        if pad_as != "do_not_pad" and self.pad_token_id is None:
            raise ValueError("padding needs a pad token, and this tokenizer has none; fix: "
                             "tokenizer.pad_token = tokenizer.eos_token")
        encodings = self._encode_batch(texts, add_special_tokens, pad_as, cut_as, max_length,
                                       pad_to_multiple_of, padding_side or self.padding_side)
        out = {"input_ids": [e.ids for e in encodings]}
        if return_attention_mask is not False:
            out["attention_mask"] = [e.attention_mask for e in encodings]
        if return_offsets_mapping:
            out["offset_mapping"] = [e.offsets for e in encodings]
        if return_tensors is not None:
            return BatchEncoding(_as_tensors(out, return_tensors))
        return BatchEncoding({k: v if batched else v[0] for k, v in out.items()})

    def _encode_batch(self, texts, add_special_tokens, pad_as, cut_as, max_length,
                      pad_to_multiple_of, padding_side):
        """encode_batch with the backend's truncation and padding set for this call only."""
        backend = self.backend
        saved_truncation, saved_padding = backend.truncation, backend.padding
        try:
            backend.no_truncation()
            backend.no_padding()
            if cut_as != "do_not_truncate":
                backend.enable_truncation(max_length, strategy=cut_as,
                                          direction=self.truncation_side)
            if pad_as != "do_not_pad":
                backend.enable_padding(
                    direction=padding_side, pad_id=self.pad_token_id, pad_token=self.pad_token,
                    length=max_length if pad_as == "max_length" else None,
                    pad_to_multiple_of=pad_to_multiple_of)
            return backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        finally:  # encode() and apply_chat_template read the backend as the file set it
            backend.no_truncation()
            backend.no_padding()
            if saved_truncation:
                backend.enable_truncation(**saved_truncation)
            if saved_padding:
                backend.enable_padding(**saved_padding)

    # ---- chat templates ---------------------------------------------------------------------
    def render_chat_with_spans(self, messages, add_generation_prompt=False, chat_template=None,
                               **template_kwargs):
        """Render a chat; returns (text, assistant_spans): the char spans [start, end) the model
        is trained on.
        Mirrors: transformers render_jinja_template with return_assistant_tokens_mask
        The built-in CHATML_TEMPLATE renders in plain Python (no jinja2 needed); others go
        through Jinja, with template_kwargs as extra variables (Qwen3's enable_thinking=False,
        tools, documents). chat_template: a template for this call instead of the tokenizer's."""
        template = self.chat_template if chat_template is None else chat_template
        if template is not None and not template.strip():
            raise ValueError(f"{self.name_or_path}: the chat template is empty; fix: write one "
                             "to chat_template.jinja, or pass --no_chat_template to feed text as "
                             "is")
        if template is None:
            raise ValueError("this tokenizer has no chat template; fix: set "
                             "tokenizer.chat_template (e.g. nanosft.tokenizer.CHATML_TEMPLATE) "
                             "or add chat_template.jinja to the folder")
        if template == CHATML_TEMPLATE:  # reads no template variable (tools included)
            for token in ("<|im_start|>", "<|im_end|>"):
                if self.token_to_id(token) is None:
                    raise ValueError(f"the ChatML template needs {token!r} in the vocabulary; "
                                     "fix: train with the default special_tokens or set another "
                                     "chat_template")
            return render_chatml(messages, add_generation_prompt)
        try:
            return render_jinja_template(template, messages, add_generation_prompt,
                                         **{**self.special_tokens_map, **template_kwargs})
        except ValueError as error:
            raise ValueError(f"{self.name_or_path}: {error}") from None

    def render_chat(self, messages, add_generation_prompt=False, **template_kwargs):
        """Render a chat to text.
        Mirrors: apply_chat_template(..., tokenize=False)"""
        return self.render_chat_with_spans(messages, add_generation_prompt, **template_kwargs)[0]

    def apply_chat_template(self, conversation, add_generation_prompt=False, tokenize=True,
                            return_assistant_tokens_mask=False, *, tools=None, documents=None,
                            chat_template=None, return_dict=False, return_tensors=None,
                            padding=False, truncation=False, max_length=None,
                            tokenizer_kwargs=None, **template_kwargs):
        """Render a chat (or a batch of chats) and by default tokenize it with
        add_special_tokens=False, as transformers does.
        Mirrors: transformers PreTrainedTokenizerBase.apply_chat_template
        Returns str (tokenize=False), list[int], or a BatchEncoding (return_dict=True, or
        return_assistant_tokens_mask=True). tools (JSON schemas), documents and template_kwargs
        are template variables (Qwen3's enable_thinking=False); padding, truncation, max_length,
        return_tensors go to __call__.
        Differs: return_dict defaults to False (transformers 5: True), so the ids stay a list as
        the walkthrough and transformers 4 have them."""
        batched = isinstance(conversation, (list, tuple)) and bool(conversation) and isinstance(
            conversation[0], (list, tuple))
        chats = list(conversation) if batched else [conversation]
        rendered = [self.render_chat_with_spans(chat, add_generation_prompt, chat_template,
                                                tools=tools, documents=documents,
                                                **template_kwargs) for chat in chats]
        texts = [text for text, _ in rendered]
        if not tokenize:
            return texts if batched else texts[0]
        if return_assistant_tokens_mask:
            if batched or return_tensors or padding or truncation:
                raise ValueError("return_assistant_tokens_mask=True: nanosft builds the mask for "
                                 "one chat, untruncated, as lists; fix: call it per chat without "
                                 "padding, truncation or return_tensors")
            return self._with_assistant_masks(*rendered[0])
        out = self(texts if batched else texts[0], add_special_tokens=False, padding=padding,
                   truncation=truncation, max_length=max_length, return_tensors=return_tensors,
                   **(tokenizer_kwargs or {}))
        return out if return_dict else out["input_ids"]

    def _with_assistant_masks(self, text, spans):
        """{input_ids, attention_mask, assistant_masks} of one rendered chat and its spans."""
        encoding = self.backend.encode(text, add_special_tokens=False)
        # Char span -> tokens through char_to_token, exactly as transformers builds assistant_masks:
        # every token touching [start, end) gets 1, so a token straddling the edge counts as an
        # assistant token.
        mask = [0] * len(encoding.ids)
        for start, end in spans:
            first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
            if first is None:  # span past the end of the text: transformers stops here too
                break
            for index in range(first, last + 1 if last else len(mask)):
                mask[index] = 1
        return BatchEncoding(input_ids=encoding.ids, attention_mask=encoding.attention_mask,
                             assistant_masks=mask)
