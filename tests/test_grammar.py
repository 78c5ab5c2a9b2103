"""Regexes and JSON schemas compiled by the grammar engine: the contract, coverage and bad input."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from helpers import regex_contract
from tiny import tokenizer

from smcsd_ppl.potentials import Constraint, JsonSchemaConstraint, RegexConstraint

# A schema whose language is regular, and the same language as a regex written by hand:
# the contract then checks every mask against brute-force matching of the regex.
CITY = {"type": "object", "properties": {"city": {"enum": ["x", "yz"]}}, "required": ["city"]}
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 2},
        "addr": {**CITY, "additionalProperties": False},
    },
    "required": ["n", "tags"],
    "additionalProperties": False,
    "$defs": {"tag": {"enum": ["a", "b"]}},
}
SCHEMA_REGEX = (
    r'\{"n": (0|[1-9][0-9]?), "tags": \[("a"|"b")(, ("a"|"b"))?\](, "addr": \{"city": ("x"|"yz")\})?\}'
)


def json_constraint(schema, tok, eos):
    return JsonSchemaConstraint(schema, tok, eos)


@pytest.mark.slow
def test_a_json_schema_constraint_keeps_the_contract():
    make = lambda pattern, tok, eos: json_constraint(SCHEMA, tok, eos)  # noqa: E731
    regex_contract(make, SCHEMA_REGEX, walks=8, depth=40).check_all()


def test_a_unicode_regex_keeps_the_contract():
    # Tokens that split a character are allowed where it can still be completed.
    regex_contract(RegexConstraint, "caf(é|e)s? ü+").check_all()


NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "languages": {
            "type": "array",
            "items": {"type": "string", "maxLength": 4},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {"$ref": "#/$defs/address"},
        "level": {"enum": ["low", "high", 3]},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "active": {"type": "boolean"},
    },
    "required": ["name", "languages", "address"],
    "additionalProperties": False,
    "$defs": {
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 5},
                "zip": {"type": "string", "pattern": "^[0-9]{3}$"},
            },
            "required": ["city"],
            "additionalProperties": False,
        }
    },
}


def random_outputs(
    constraint: Constraint, eos: int, n: int, seed: int, max_tokens: int = 300
) -> list[list[int]]:
    """Walks through allowed tokens (EOS as soon as it is allowed) until EOS."""
    rng, outs = random.Random(seed), []
    for _ in range(n):
        ids: list[int] = []
        for _ in range(max_tokens):
            mask = constraint.next_mask([ids])[0]
            if mask[eos]:
                break
            ids.append(rng.choice(mask.nonzero().flatten().tolist()))
        else:
            raise AssertionError(f"no complete output within {max_tokens} tokens: {ids}")
        outs.append(ids)
    return outs


def test_every_output_of_a_nested_schema_is_valid_and_fields_vary():
    tok = tokenizer()
    schema = JsonSchemaConstraint(NESTED, tok, [tok.eos_token_id])
    outs = random_outputs(schema, tok.eos_token_id, 40, seed=0)
    objects = [json.loads(tok.decode(ids)) for ids in outs]
    for obj in objects:
        jsonschema.validate(obj, NESTED)
    assert {len(o["languages"]) for o in objects} == {1, 2, 3}  # minItems..maxItems
    assert any("level" in o for o in objects) and any("level" not in o for o in objects)  # optional


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "ab", "languages": [], "address": {"city": "c"}}',  # minItems
        '{"name": "ab", "languages": ["a", "b", "c", "d"], "address": {"city": "c"}}',  # maxItems
        '{"name": "abcdefg", "languages": ["a"], "address": {"city": "c"}}',  # maxLength
        '{"name": "ab", "languages": ["a"]}',  # a required property
        '{"name": "ab", "languages": ["a"], "address": {"city": "c", "zip": "12"}}',  # pattern
        '{"name": "ab", "languages": ["a"], "address": {"city": "c"}, "level": "mid"}',  # enum
        '{"name": "ab", "languages": ["a"], "address": {"city": "c"}, "extra": 1}',  # additionalProperties
        '{"name":"ab","languages":["a"],"address":{"city":"c"}}',  # not the json.dumps layout
    ],
)
def test_invalid_texts_are_refused(text):
    tok = tokenizer()
    eos = tok.eos_token_id
    schema = JsonSchemaConstraint(NESTED, tok, [eos])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(text), NESTED)  # the texts are invalid indeed...
        if "," in text and ", " not in text:
            raise jsonschema.ValidationError("layout")
    assert schema.allows([tok.encode(text) + [eos]]) == [False]  # ...and refused as outputs
    good = '{"name": "ab", "languages": ["a"], "address": {"city": "c", "zip": "123"}, "level": 3}'
    assert schema.allows([tok.encode(good) + [eos]]) == [True]


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (
            lambda t, e: JsonSchemaConstraint({"type": "string", "maxLenght": 3}, t, e),
            "unknown keyword(s) 'maxLenght'",
        ),
        (
            lambda t, e: JsonSchemaConstraint({"type": "strin"}, t, e),
            "JSON schema at #/type: 'strin' is not one of ['array', 'boolean',",
        ),
        (
            lambda t, e: JsonSchemaConstraint({"properties": {"a/b": {"minLength": -1}}}, t, e),
            "JSON schema at #/properties/a~1b/minLength: -1 is less than the minimum of 0",
        ),
        (lambda t, e: JsonSchemaConstraint({"properties": {"a": {"not": {}}}}, t, e), "keyword(s): not"),
        (lambda t, e: JsonSchemaConstraint({"type": "array", "uniqueItems": True}, t, e), "uniqueItems"),
        (
            lambda t, e: JsonSchemaConstraint({"type": "string", "format": "colour"}, t, e),
            "Unknown format: colour",
        ),
        (
            lambda t, e: JsonSchemaConstraint({"type": "string", "minLength": 5, "maxLength": 2}, t, e),
            "minLength",
        ),
        (lambda t, e: JsonSchemaConstraint({"enum": []}, t, e), "nsatisfiable"),
        (lambda t, e: JsonSchemaConstraint(False, t, e), "nsatisfiable"),
        (lambda t, e: JsonSchemaConstraint({"$ref": "#/$defs/none"}, t, e), "/$defs/none"),
        (lambda t, e: JsonSchemaConstraint("{not json", t, e), "not valid JSON"),
        (lambda t, e: JsonSchemaConstraint([1], t, e), "expected an object"),
        (lambda t, e: RegexConstraint(r"\d+(", t, e), "unclosed group"),
        (lambda t, e: RegexConstraint(r"(?=a)a", t, e), "look-around"),
        (lambda t, e: RegexConstraint(r"[^\s\S]", t, e), "unsatisfiable"),
        (lambda t, e: RegexConstraint(b"a+", t, e), "must be a string"),
        (lambda t, e: RegexConstraint("a+", t, []), "EOS"),
    ],
)
def test_bad_constraints_get_one_line_naming_the_problem(make, needle):
    tok = tokenizer()
    with pytest.raises(ValueError) as info:
        make(tok, [tok.eos_token_id])
    message = str(info.value)
    assert needle in message and "\n" not in message and type(info.value) is ValueError, message


def test_a_regex_that_matches_only_the_empty_text_allows_only_eos():
    tok = tokenizer()
    empty = RegexConstraint("(abc){0}", tok, [tok.eos_token_id])
    mask = empty.next_mask([[]])[0]
    assert mask.nonzero().flatten().tolist() == [tok.eos_token_id] and empty.is_complete([])


BOUNDED = {  # an array of strings and a nested object, every length bounded
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "languages": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "country": {"type": "string", "maxLength": 20},
            },
            "required": ["city", "country"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "languages", "address"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_a_nested_schema_constrains_the_default_pair_and_every_output_is_valid(default_smcsd):
    from smcsd_ppl import SMCConfig, SMCSDModel

    pair = default_smcsd
    schema = JsonSchemaConstraint(BOUNDED, pair.tokenizer, pair.eos_token_ids)
    texts = [
        "Ana Silva lives in Lima, Peru, and speaks Spanish and English.",
        "Li Wei, who speaks Mandarin, lives in Shanghai, China.",
    ]
    prompts = [f"Extract the name, languages and address (city, country) as JSON: {t}" for t in texts]
    config = SMCConfig(
        n_particles=4, block_size=4, draft_temperature=0.7, target_temperature=0.7, max_new_tokens=160, seed=1
    )
    outs = pair.run([SMCSDModel(p, schema) for p in prompts], config)
    eos = set(pair.eos_token_ids)
    for out in outs:
        assert out.message == "" and out.token_ids[-1] in eos, out.message
        jsonschema.validate(json.loads(out.text), BOUNDED)
        for p in out.smc.particles:  # every weighted particle is a complete, valid object
            if p.log_weight > float("-inf"):
                assert p.token_ids[-1] in eos and schema.allows([p.token_ids]) == [True]
                jsonschema.validate(json.loads(pair.decode(p.token_ids[:-1])), BOUNDED)


@pytest.mark.slow
def test_a_tokenizer_that_is_not_a_fast_one_is_read_from_its_token_bytes(monkeypatch):
    import transformers

    from smcsd_ppl.potentials import grammar

    class NotThisOne:  # every tokenizer then takes the token-bytes path
        pass

    monkeypatch.setattr(transformers, "PreTrainedTokenizerFast", NotThisOne)
    monkeypatch.setattr(grammar, "_TOKENIZERS", grammar.weakref.WeakKeyDictionary())
    regex_contract(RegexConstraint, r"(the|a) [a-z]+( [a-z]+)?\.").check_all()
    tok = tokenizer()
    assert type(grammar.engine_tokenizer(tok, (tok.eos_token_id,))).__name__ == "LLTokenizer"
    assert list(grammar._TOKENIZERS[tok]) == [((tok.eos_token_id,), None)]


def test_the_base_class_answers_allows_and_is_complete_from_the_masks():
    import helpers

    class Declared(helpers.NoOneZero):
        def __init__(self):
            super().__init__(helpers.V, [helpers.EOS])

    c, eos = Declared(), helpers.EOS
    seqs = [[2, 1], [1, 0], [2, eos], [1, eos], [], [2, eos, 1]]
    assert c.allows(seqs) == [True, False, True, False, True, False]
    assert c.is_complete([1, 2]) and not c.is_complete([1])
    with pytest.raises(NotImplementedError, match="NoOneZero declares no eos_token_ids"):
        helpers.NoOneZero().is_complete([2])
    with pytest.raises(NotImplementedError, match="must define next_mask"):
        Constraint().next_mask([[]])


@pytest.mark.parametrize("bad", ["[a-z]+", object()])
def test_anything_but_a_constraint_is_refused_in_one_line(bad):
    from smcsd_ppl import SMCSDModel

    with pytest.raises(ValueError) as info:
        SMCSDModel([1, 2], bad)
    assert "RegexConstraint(pattern" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("kind", ["regex", "genlm potential"])
@pytest.mark.parametrize("mode", ["proposal", "critic"])
def test_constraints_compose_with_twists_and_conditions(tiny_smcsd, kind, mode):
    import re

    from genlm.control import BoolFSA

    from smcsd_ppl import SMCConfig, SMCSDModel
    from smcsd_ppl.potentials import PotentialConstraint

    pattern = "[a-z]{1,4}( [a-z]{1,4}){0,5}"
    pair = tiny_smcsd
    if kind == "regex":
        constraint = RegexConstraint(pattern, pair.tokenizer, pair.eos_token_ids)
    else:
        constraint = PotentialConstraint(BoolFSA.from_regex(pattern), pair.tokenizer, pair.eos_token_ids)

    class Program(SMCSDModel):
        async def step(self):
            await self.extend()
            self.condition("x" not in self.text)
            if not self.finished:
                self.twist(-0.1 * len(self.text))

    config = SMCConfig(
        n_particles=4, block_size=2, max_new_tokens=6, draft_temperature=1.0, target_temperature=1.0
    )
    outs = pair.run([Program("The quick brown fox", constraint, mode) for _ in range(3)], config)
    for out in outs:
        for p in out.smc.particles:
            if p.log_weight > float("-inf"):
                assert constraint.allows([p.token_ids]) == [True] and "x" not in p.text
                if p.token_ids and p.token_ids[-1] in pair.eos_token_ids:
                    assert re.fullmatch(pattern, pair.decode(p.token_ids[:-1]))
