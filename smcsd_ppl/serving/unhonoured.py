"""The fields of OpenAI's API (and vLLM's) this server cannot honour: a body that uses one is refused.

Nothing a client sends is ignored in silence: a field is honoured exactly, or refused with 400
naming it; these are refused unless they hold a value that means "not used" (null always does).
"""

from __future__ import annotations

from .errors import invalid

# Fields of OpenAI's API (and vLLM's) this server cannot honour, with the values that mean "not
# used" (null always does): a body that uses one is refused in one line naming it.
UNSUPPORTED = {
    "frequency_penalty": (0,),
    "presence_penalty": (0,),
    "repetition_penalty": (1,),
    "min_tokens": (0,),
    "functions": ([],),
    "function_call": ("none",),
    "suffix": ("",),
    "best_of": (1,),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "verbosity": (),
    "web_search_options": (),
    "store": (False,),
    "metadata": ({},),
    "service_tier": ("auto", "default"),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "guided_json": (),
    "guided_regex": (),
    "guided_grammar": (),
    "guided_choice": (),
}
HINTS = {  # where a refused field has a way here
    "guided_json": "response_format",
    "guided_regex": "regex",
    "guided_grammar": "grammar",
    "guided_choice": "regex",
    "best_of": "n",
}


def refuse_unhonoured(request, body: dict) -> None:
    """Refuse, naming it, a field this server would not honour: a used ``UNSUPPORTED`` one, or one unknown."""
    for name in request.model_extra or {}:
        if name not in UNSUPPORTED:
            raise invalid(f"{name} is not a field this server knows", name)
    for name, unused in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value not in unused:
            hint = f"; use {HINTS[name]}" if name in HINTS else ""
            raise invalid(f"{name} is not supported by this server{hint}", name)
