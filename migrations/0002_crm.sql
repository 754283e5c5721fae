-- CRM tables behind the `crm-db` tool pack: customers, appointments, invoices.
-- Customer ids are the CRM's own (`cust_001`); every row belongs to one business.

CREATE TABLE IF NOT EXISTS customers (
    business_id uuid NOT NULL REFERENCES businesses (id) ON DELETE CASCADE,
    id          text NOT NULL,
    name        text NOT NULL,
    phone       text,
    email       text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (business_id, id)
);

CREATE TABLE IF NOT EXISTS appointments (
    id               text PRIMARY KEY,
    business_id      uuid NOT NULL,
    customer_id      text NOT NULL,
    service          text NOT NULL,
    location         text NOT NULL,
    starts_at        timestamptz NOT NULL,
    duration_minutes integer NOT NULL,
    status           text NOT NULL DEFAULT 'scheduled'
                     CHECK (status IN ('scheduled', 'cancelled', 'completed')),
    FOREIGN KEY (business_id, customer_id) REFERENCES customers (business_id, id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS appointments_customer ON appointments (business_id, customer_id, starts_at);

CREATE TABLE IF NOT EXISTS invoices (
    id           text PRIMARY KEY,
    business_id  uuid NOT NULL,
    customer_id  text NOT NULL,
    amount_cents bigint NOT NULL CHECK (amount_cents >= 0),
    currency     text NOT NULL DEFAULT 'USD',
    due_date     date NOT NULL,
    description  text NOT NULL,
    status       text NOT NULL DEFAULT 'open' CHECK (status IN ('open', 'paid', 'void')),
    FOREIGN KEY (business_id, customer_id) REFERENCES customers (business_id, id) ON DELETE CASCADE
);
CREATE INDEX IF NOT EXISTS invoices_customer ON invoices (business_id, customer_id, due_date);
