"""Token-level stop checks (stop strings need text: the engine core checks those)."""
from __future__ import annotations

from jaxserve.request import FinishReason, Request


def max_output_tokens(request: Request, max_model_len: int) -> int:
    """Output tokens the request may produce: max_tokens, or up to the model length
    when max_tokens is None."""
    limit = max_model_len - request.num_prompt_tokens
    max_tokens = request.sampling_params.max_tokens
    return limit if max_tokens is None else min(max_tokens, limit)


def check_stop(request: Request, max_model_len: int) -> tuple[FinishReason, int | None] | None:
    """(finish_reason, stop_reason) if the last output token ends the request.

    EOS (unless ignore_eos) and stop_token_ids only count once min_tokens outputs exist;
    they take precedence over the length limits when both apply to the same token."""
    params = request.sampling_params
    num_out = len(request.output_token_ids)
    last = request.output_token_ids[-1]
    if num_out >= params.min_tokens:
        if not params.ignore_eos and last in request.eos_token_ids:
            return FinishReason.STOP, None
        if last in params.stop_token_ids:
            return FinishReason.STOP, last
    if num_out >= max_output_tokens(request, max_model_len):
        return FinishReason.LENGTH, None
    if request.num_tokens >= max_model_len:
        return FinishReason.LENGTH, None
    return None


def ends_on_stop_token(request: Request, new_token_ids: list[int]) -> bool:
    """The request stopped on the last of these tokens because it is an EOS or stop
    token (a grammar that completes on an ordinary token, a stop string: no)."""
    if request.finish_reason is not FinishReason.STOP or not new_token_ids:
        return False
    last = new_token_ids[-1]
    return last in request.eos_token_ids or last == request.stop_reason
