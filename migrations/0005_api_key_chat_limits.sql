-- Per-key limits of the chat-completions loop (`POST /v1/chat/completions`): at most this
-- many rounds of fleet calls, at most this many calls per round, and a stop-after gate
-- (`first`: tools only in the first round; `burst`: none after the first round with
-- several calls). NULL: the gateway's configuration decides. A request's own `toolfleet`
-- object may only tighten them. `toolfleet admin keys limit` sets them.

ALTER TABLE api_keys
    ADD COLUMN IF NOT EXISTS chat_max_rounds integer
        CHECK (chat_max_rounds BETWEEN 1 AND 64),
    ADD COLUMN IF NOT EXISTS chat_max_calls_per_round integer
        CHECK (chat_max_calls_per_round BETWEEN 1 AND 256),
    ADD COLUMN IF NOT EXISTS chat_stop_after text
        CHECK (chat_stop_after IN ('first', 'burst'));

GRANT SELECT (chat_max_rounds, chat_max_calls_per_round, chat_stop_after)
    ON api_keys TO toolfleet_gateway;
