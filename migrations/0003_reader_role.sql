-- The read-only role tools run as (`SET ROLE toolfleet_reader` after connecting).
--
-- Roles are cluster-wide while grants and policies live in each database, so the role is
-- created only when missing and a concurrent creation by another database's migration is
-- tolerated. The role cannot log in; the worker's login user must be a member of it
-- (superusers are).
--
-- Column grants leave out what a caller must never hear (bookings.internal_notes,
-- customer_email, businesses.twilio_number, the calls table). Row-level security limits
-- every table to the business in the `toolfleet.business_id` setting, which the worker
-- sets per transaction from the turn's tenant.

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'toolfleet_reader') THEN
        CREATE ROLE toolfleet_reader NOLOGIN;
    END IF;
EXCEPTION
    WHEN duplicate_object OR unique_violation THEN NULL;
END
$$;

DO $$
BEGIN
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO toolfleet_reader', current_database());
END
$$;

CREATE OR REPLACE FUNCTION toolfleet_business() RETURNS uuid
    LANGUAGE sql STABLE
AS $$ SELECT NULLIF(current_setting('toolfleet.business_id', true), '')::uuid $$;

GRANT USAGE ON SCHEMA public TO toolfleet_reader;
GRANT EXECUTE ON FUNCTION toolfleet_business() TO toolfleet_reader;

GRANT SELECT (id, name, industry, phone, email, ai_config, services, working_hours, updated_at)
    ON businesses TO toolfleet_reader;
GRANT SELECT (id, business_id, customer_name, customer_phone, service, booking_datetime,
              duration_minutes, status, confirmed_at, price, customer_notes, updated_at)
    ON bookings TO toolfleet_reader;
GRANT SELECT (id, business_id, topic, content, updated_at) ON policies TO toolfleet_reader;
GRANT SELECT (id, business_id, question, answer, tags, updated_at) ON faqs TO toolfleet_reader;
GRANT SELECT (business_id, id, name) ON customers TO toolfleet_reader;
GRANT SELECT ON appointments, invoices TO toolfleet_reader;

ALTER TABLE businesses ENABLE ROW LEVEL SECURITY;
ALTER TABLE bookings ENABLE ROW LEVEL SECURITY;
ALTER TABLE policies ENABLE ROW LEVEL SECURITY;
ALTER TABLE faqs ENABLE ROW LEVEL SECURITY;
ALTER TABLE calls ENABLE ROW LEVEL SECURITY;
ALTER TABLE customers ENABLE ROW LEVEL SECURITY;
ALTER TABLE appointments ENABLE ROW LEVEL SECURITY;
ALTER TABLE invoices ENABLE ROW LEVEL SECURITY;

DROP POLICY IF EXISTS tenant_read ON businesses;
CREATE POLICY tenant_read ON businesses FOR SELECT TO toolfleet_reader
    USING (id = toolfleet_business());
DROP POLICY IF EXISTS tenant_read ON bookings;
CREATE POLICY tenant_read ON bookings FOR SELECT TO toolfleet_reader
    USING (business_id = toolfleet_business());
DROP POLICY IF EXISTS tenant_read ON policies;
CREATE POLICY tenant_read ON policies FOR SELECT TO toolfleet_reader
    USING (business_id = toolfleet_business());
DROP POLICY IF EXISTS tenant_read ON faqs;
CREATE POLICY tenant_read ON faqs FOR SELECT TO toolfleet_reader
    USING (business_id = toolfleet_business());
DROP POLICY IF EXISTS tenant_read ON customers;
CREATE POLICY tenant_read ON customers FOR SELECT TO toolfleet_reader
    USING (business_id = toolfleet_business());
DROP POLICY IF EXISTS tenant_read ON appointments;
CREATE POLICY tenant_read ON appointments FOR SELECT TO toolfleet_reader
    USING (business_id = toolfleet_business());
DROP POLICY IF EXISTS tenant_read ON invoices;
CREATE POLICY tenant_read ON invoices FOR SELECT TO toolfleet_reader
    USING (business_id = toolfleet_business());
