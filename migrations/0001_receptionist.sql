-- Receptionist tables: businesses, calls, bookings, policies, faqs.

CREATE TABLE IF NOT EXISTS businesses (
    id            uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    name          text NOT NULL,
    industry      text,
    phone         text,
    email         text,
    twilio_number text UNIQUE,
    ai_config     jsonb NOT NULL DEFAULT '{}'::jsonb,
    services      jsonb NOT NULL DEFAULT '[]'::jsonb,
    working_hours jsonb NOT NULL DEFAULT '{}'::jsonb,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS calls (
    id               uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    business_id      uuid NOT NULL REFERENCES businesses (id) ON DELETE CASCADE,
    call_sid         text UNIQUE,
    caller_phone     text,
    started_at       timestamptz,
    ended_at         timestamptz,
    duration_seconds integer,
    transcript       text,
    intent           text,
    outcome          text,
    sentiment_score  double precision,
    confidence_score double precision,
    recording_url    text,
    created_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS calls_business_started ON calls (business_id, started_at);

CREATE TABLE IF NOT EXISTS bookings (
    id               uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    business_id      uuid NOT NULL REFERENCES businesses (id) ON DELETE CASCADE,
    call_id          uuid REFERENCES calls (id) ON DELETE SET NULL,
    customer_name    text NOT NULL,
    customer_phone   text,
    customer_email   text,
    service          text NOT NULL,
    booking_datetime timestamptz NOT NULL,
    duration_minutes integer,
    status           text NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'confirmed', 'cancelled', 'completed', 'no_show')),
    confirmed_at     timestamptz,
    price            numeric(10, 2),
    customer_notes   text,
    internal_notes   text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS bookings_business_datetime ON bookings (business_id, booking_datetime);

CREATE TABLE IF NOT EXISTS policies (
    id          uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    business_id uuid NOT NULL REFERENCES businesses (id) ON DELETE CASCADE,
    topic       text NOT NULL CHECK (btrim(topic) <> ''),
    content     text NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS policies_business_topic ON policies (business_id, lower(topic));

CREATE TABLE IF NOT EXISTS faqs (
    id          uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    business_id uuid NOT NULL REFERENCES businesses (id) ON DELETE CASCADE,
    question    text NOT NULL,
    answer      text NOT NULL,
    tags        text[] NOT NULL DEFAULT '{}',
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS faqs_business ON faqs (business_id);
