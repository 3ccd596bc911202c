"""Request and size validation: every refusal is one line naming the field and what is allowed."""

from __future__ import annotations

import json

import pytest

from training.errors import UserError
from training.serve.errors import RequestError
from training.serve.spec import (
    Limits,
    ServingSpec,
    Size,
    decode_body,
    parse_size,
    parse_sizes,
    validate_request,
)

SPEC = ServingSpec(sizes=(Size(1024, 1024), Size(768, 1024)), complex_human_instruction=("chi",),
                   max_sequence_length=300, limits=Limits(max_steps=50))


def test_sizes_parse_in_order_and_refuse_non_multiples_of_32():
    assert parse_sizes("1024x1024, 768x1024,1024x1024", flag="--shapes") == (Size(1024, 1024), Size(768, 1024))
    with pytest.raises(UserError) as err:
        parse_size("1000x1024", flag="--shapes")
    assert str(err.value) == ("--shapes 1000x1024: 1000 is not a positive multiple of 32 (DC-AE compresses 32x); "
                              "use e.g. 992x1024")
    for bad in ("1024", "1024x", "axb", "0x64", "-32x64"):
        with pytest.raises(UserError, match="--shapes"):
            parse_size(bad, flag="--shapes")


def _refusal(body: dict | bytes | str, content_type: str = "application/json") -> RequestError:
    raw = body if isinstance(body, bytes | str) else json.dumps(body)
    with pytest.raises(RequestError) as err:
        validate_request(decode_body(raw, content_type, max_body_bytes=4096), SPEC, random_seed=5)
    assert err.value.status_code == 400
    assert "\n" not in err.value.message and err.value.message == err.value.phrase
    return err.value


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": "a fox", "height": 512, "width": 512},
     "size 512x512 (height x width) is not served; this endpoint serves 1024x1024, 768x1024"),
    ({"prompt": "a fox", "steps": 0}, "field steps=0: out of range; allowed 1 to 50"),
    ({"prompt": "a fox", "steps": 51}, "field steps=51: out of range; allowed 1 to 50"),
    ({"prompt": "a fox", "steps": 2.5}, "field steps=2.5: must be an integer from 1 to 50"),
    ({"prompt": "a fox", "steps": True}, "field steps=True: must be an integer from 1 to 50"),
    ({"prompt": "   "}, 'field prompt: empty; give the text to draw, e.g. {"prompt": "a red fox in the snow"}'),
    ({}, 'field prompt: missing; give the text to draw, e.g. {"prompt": "a red fox in the snow"}'),
    ({"prompt": 3}, "field prompt=3: must be a string"),
    ({"prompt": "x" * 2001}, "field prompt: 2001 characters; the limit is 2000"),
    ({"prompt": "a fox", "guidance_scale": 25}, "field guidance_scale=25: a number from 0 to 20"),
    ({"prompt": "a fox", "seed": -1}, "field seed=-1: out of range; allowed 0 to 4294967295"),
    ({"prompt": "a fox", "step": 4}, "unknown field 'step'; allowed: prompt, negative_prompt, steps, "
                                     "guidance_scale, seed, height, width"),
    ('["a fox"]', 'request body must be a JSON object, e.g. {"prompt": "a red fox in the snow"}'),
    ("{not json", "request body is not JSON (Expecting property name enclosed in double quotes: line 1 column 2 "
                  "(char 1))"),
])
def test_bad_requests_are_400_with_one_line(body, message):
    assert _refusal(body).message == message


def test_oversized_body_and_wrong_content_type_are_refused_before_parsing():
    assert _refusal(b'{"prompt": "' + b"a" * 5000 + b'"}').message == "request body is 5014 bytes; the limit is 4096"
    assert _refusal('{"prompt": "a fox"}', "text/plain").message == "Content-Type 'text/plain': send application/json"


def test_defaults_fill_a_minimal_request():
    request = validate_request(decode_body('{"prompt": "a fox"}', "application/json; charset=utf-8",
                                           max_body_bytes=4096), SPEC, random_seed=5)
    assert (request.steps, request.guidance_scale, request.seed, request.size, request.negative_prompt) == (
        20, 4.5, 5, Size(1024, 1024), "")


def test_serving_json_round_trips():
    assert ServingSpec.from_dict(json.loads(json.dumps(SPEC.to_dict()))) == SPEC
