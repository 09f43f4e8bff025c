"""The JSON bodies of the draft server's API, as /openapi.json publishes them: the /draft and /draft/batch
requests, built for the loaded model's limits, and the responses. server.py serves them."""

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

import draft_model


def whole_number(value):
    """JSON Schema counts 6.0 as an integer, so the schema's promise holds only if it is accepted as 6;
    a bool or a string is still refused (no coercion to a number)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


JsonInt = Annotated[StrictInt, BeforeValidator(whole_number)]


def request_models(vocab_size: int, max_context: int, max_draft_tokens: int, max_items: int) -> tuple[type, type]:
    """The /draft and /draft/batch bodies, built for the loaded model so /openapi.json states its limits.

    The token-id bounds are checked by the handler, not by pydantic, so that an id from another
    tokenizer gets a 400 naming the drafter's vocabulary; within a batch that 400 is one item's answer,
    so the batch's item schema leaves the bounds out (a schema-valid batch is always answered 200)."""

    class DraftFields(BaseModel):
        model_config = ConfigDict(extra="forbid")
        token_ids: list[JsonInt] = Field(
            description=f"Token ids of the conversation so far: 1..{max_context} ids (more with truncate), "
            f"each in 0..{vocab_size - 1}.",
            examples=[[min(token_id, vocab_size - 1) for token_id in (1, 2, 3)]],
        )
        max_tokens: JsonInt = Field(
            default=min(16, max_draft_tokens), ge=1, le=max_draft_tokens, description="Most draft tokens to return."
        )
        return_logprobs: StrictBool = Field(
            default=False, description="Also return the drafter's log-probability of each draft token."
        )
        min_confidence: StrictFloat | None = Field(
            default=None,
            ge=0.0,
            le=1.0,
            description="Adaptive draft length: stop after a draft token whose probability is below this "
            "(that token is still returned). Default: the server's --min-confidence.",
        )
        lookup_min_match: (
            Annotated[StrictInt, Field(ge=0, le=draft_model.LOOKUP_MAX_MATCH), BeforeValidator(whole_number)] | None
        ) = Field(
            default=None,
            description="Hybrid drafting: when token_ids end in an n-gram of at least this many tokens that occurred "
            "earlier in token_ids, return what followed it (source 'lookup') instead of a model draft; 0: off. "
            "Default: the server's --lookup-min-match.",
        )
        truncate: StrictBool = Field(
            default=False,
            description=f"Accept more than {max_context} ids and draft from the most recent ones "
            "(truncated_tokens in the answer says how many were dropped from the front).",
        )
        session_id: StrictStr | None = Field(
            default=None, max_length=256, description="Conversation id for routers that hash the body; not used here."
        )

    def state_model_limits(schema: dict) -> None:
        schema["properties"]["token_ids"].update(
            minItems=1, items={"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
        )
        # At most max_context ids unless the request asks for truncation.
        schema["if"] = {"properties": {"truncate": {"const": True}}, "required": ["truncate"]}
        schema["else"] = {"properties": {"token_ids": {"maxItems": max_context}}}

    class DraftRequest(DraftFields):
        model_config = ConfigDict(extra="forbid", json_schema_extra=state_model_limits)

    class BatchItem(DraftFields):
        pass

    class BatchRequest(BaseModel):
        model_config = ConfigDict(extra="forbid")
        items: list[BatchItem] = Field(
            min_length=1, max_length=max_items, description="Draft requests, answered in this order."
        )

    return DraftRequest, BatchRequest


class DraftResponse(BaseModel):
    draft_token_ids: list[int] = Field(
        description="Greedy draft tokens; fewer than max_tokens at EOS or the context limit."
    )
    cached_tokens: int = Field(description="Prompt tokens whose KV came from the prefix cache.")
    logprobs: list[float] | None = Field(
        description="Log-probability of each draft token, if asked for (null for a lookup draft: no model ran)."
    )
    source: Literal["model", "lookup"] = Field(
        description="'model': the drafter's greedy tokens; 'lookup': copied from token_ids (hybrid drafting)."
    )
    truncated_tokens: int = Field(default=0, description="Ids dropped from the front of token_ids (truncate).")


class BatchItemResult(BaseModel):
    status: int = Field(description="The status /draft would have answered for this item alone.")
    draft: DraftResponse | None = Field(default=None, description="The draft, when status is 200.")
    detail: str | None = Field(default=None, description="What went wrong, when status is not 200.")


class BatchResponse(BaseModel):
    results: list[BatchItemResult] = Field(description="One result per item, in the order of the items.")


class ErrorResponse(BaseModel):
    detail: str
