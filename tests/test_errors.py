"""RequestError: bad input that names its field, raised by every check of a request's input."""

from __future__ import annotations

import pickle

import pytest

from engine.core.validation import validate_prompt
from engine.errors import RequestError
from engine.ipc.wire import params_from_wire
from engine.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputs


def test_a_request_error_is_a_value_error_carrying_its_field():
    err = RequestError("max_tokens must be >= 1, got 0", "max_tokens")
    assert isinstance(err, ValueError)
    assert str(err) == err.message == "max_tokens must be >= 1, got 0"
    assert err.param == "max_tokens"
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is RequestError
    assert (again.message, again.param) == (err.message, err.param)


@pytest.mark.parametrize(
    "make, param",
    [
        (lambda: SamplingParams(temperature=-1.0), "temperature"),
        (lambda: SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
        (lambda: SamplingParams(stop=[""]), "stop"),
        (lambda: SamplingParams(structured_outputs={"regex": ""}), "structured_outputs"),
        (lambda: StructuredOutputs(json="{"), "structured_outputs"),
        (lambda: validate_prompt([], SamplingParams(), 100, 64), "prompt"),
        (lambda: validate_prompt([100], SamplingParams(), 100, 64), "prompt"),
        (lambda: validate_prompt([1] * 60, SamplingParams(max_tokens=5), 100, 64), "max_tokens"),
        (lambda: params_from_wire({"temperature": "hot"}), "temperature"),
        (lambda: params_from_wire({"bogus": 1}), "params"),
        (lambda: params_from_wire({"stop_token_ids": [1.5]}), "stop_token_ids"),
    ],
)
def test_input_checks_name_the_field(make, param):
    with pytest.raises(RequestError) as info:
        make()
    assert info.value.param == param
