-- Demo data for two businesses. Idempotent: rows are keyed by fixed ids and never
-- overwritten. Booking and appointment times are relative to the day the seed runs, in
-- each business's time zone (ai_config.timezone).
--
-- Bright Smile Dental  b1000000-0000-4000-8000-000000000001
-- Harbour Hair Studio  b2000000-0000-4000-8000-000000000002
-- The caller +61400111222 (Sarah Mitchell) has bookings at both businesses.

INSERT INTO businesses (id, name, industry, phone, email, twilio_number, ai_config, services, working_hours)
VALUES
('b1000000-0000-4000-8000-000000000001', 'Bright Smile Dental', 'dental clinic',
 '+61 2 9000 1111', 'hello@brightsmile.example', '+61280001111',
 '{"timezone": "Australia/Sydney", "tone": "warm", "language": "en-AU", "assistant_name": "Echo"}',
 '[{"name": "check-up and clean", "duration_minutes": 45, "price": 180},
   {"name": "teeth whitening", "duration_minutes": 60, "price": 450},
   {"name": "emergency appointment", "duration_minutes": 30, "price": 120}]',
 '{"monday": {"open": "08:00", "close": "17:00"}, "tuesday": {"open": "08:00", "close": "17:00"},
   "wednesday": {"open": "08:00", "close": "17:00"}, "thursday": {"open": "08:00", "close": "19:00"},
   "friday": {"open": "08:00", "close": "17:00"}, "saturday": {"open": "09:00", "close": "13:00"},
   "sunday": null}'),
('b2000000-0000-4000-8000-000000000002', 'Harbour Hair Studio', 'hair salon',
 '+61 2 9000 2222', 'bookings@harbourhair.example', '+61280002222',
 '{"timezone": "Australia/Sydney", "tone": "friendly", "language": "en-AU", "assistant_name": "Echo"}',
 '[{"name": "women''s cut and blow-dry", "duration_minutes": 60, "price": 95},
   {"name": "men''s cut", "duration_minutes": 30, "price": 45},
   {"name": "full colour", "duration_minutes": 120, "price": 180}]',
 '{"monday": null, "tuesday": {"open": "09:00", "close": "18:00"},
   "wednesday": {"open": "09:00", "close": "18:00"}, "thursday": {"open": "09:00", "close": "20:00"},
   "friday": {"open": "09:00", "close": "18:00"}, "saturday": {"open": "08:00", "close": "16:00"},
   "sunday": null}')
ON CONFLICT (id) DO NOTHING;

INSERT INTO calls (id, business_id, call_sid, caller_phone, started_at, ended_at, duration_seconds,
                   transcript, intent, outcome, sentiment_score, confidence_score)
VALUES
('c0000000-0000-4000-8000-00000000c001', 'b1000000-0000-4000-8000-000000000001', 'CA_demo_0001',
 '+61400111222', now() - interval '20 days', now() - interval '20 days' + interval '3 minutes', 180,
 'Caller booked a check-up and clean.', 'booking', 'booked', 0.8, 0.93)
ON CONFLICT (id) DO NOTHING;

WITH local_day AS (
    SELECT date_trunc('day', now() AT TIME ZONE 'Australia/Sydney') AS today
)
INSERT INTO bookings (id, business_id, call_id, customer_name, customer_phone, customer_email, service,
                      booking_datetime, duration_minutes, status, confirmed_at, price,
                      customer_notes, internal_notes)
SELECT v.id::uuid, v.business_id::uuid, v.call_id::uuid, v.customer_name, v.customer_phone, v.customer_email,
       v.service, (local_day.today + v.offset_local::interval) AT TIME ZONE 'Australia/Sydney',
       v.duration_minutes, v.status,
       CASE WHEN v.status = 'confirmed' THEN now() - interval '1 day' END,
       v.price, v.customer_notes, v.internal_notes
FROM local_day, (VALUES
    ('a0000000-0000-4000-8000-00000000a001', 'b1000000-0000-4000-8000-000000000001',
     'c0000000-0000-4000-8000-00000000c001', 'Sarah Mitchell', '+61400111222', 'sarah@example.com',
     'check-up and clean', '3 days 10 hours 30 minutes', 45, 'confirmed', 180.00::numeric,
     'Please use the mint polish.', 'Owes $20 from the last visit; do not mention on calls.'),
    ('a0000000-0000-4000-8000-00000000a002', 'b1000000-0000-4000-8000-000000000001',
     NULL, 'Sarah Mitchell', '+61400111222', 'sarah@example.com',
     'emergency appointment', '-60 days -15 hours', 30, 'completed', 120.00::numeric,
     NULL, 'Cracked molar; referred to Dr Lee.'),
    ('a0000000-0000-4000-8000-00000000a003', 'b1000000-0000-4000-8000-000000000001',
     NULL, 'James Okafor', '+61400333444', 'james@example.com',
     'teeth whitening', '6 days 14 hours', 60, 'pending', 450.00::numeric,
     NULL, 'Asked for a discount.'),
    ('b0000000-0000-4000-8000-00000000b001', 'b2000000-0000-4000-8000-000000000002',
     NULL, 'Sarah Mitchell', '+61400111222', 'sarah@example.com',
     'women''s cut and blow-dry', '10 days 14 hours', 60, 'confirmed', 95.00::numeric,
     NULL, 'VIP: always offer a coffee.')
) AS v(id, business_id, call_id, customer_name, customer_phone, customer_email, service, offset_local,
       duration_minutes, status, price, customer_notes, internal_notes)
ON CONFLICT (id) DO NOTHING;

INSERT INTO policies (id, business_id, topic, content)
VALUES
('d0000000-0000-4000-8000-00000000d001', 'b1000000-0000-4000-8000-000000000001', 'cancellation',
 'Please give us at least 24 hours'' notice to cancel or reschedule; cancellations within 24 hours incur a $50 fee.'),
('d0000000-0000-4000-8000-00000000d002', 'b1000000-0000-4000-8000-000000000001', 'late arrival',
 'If you arrive more than 15 minutes late we may need to shorten or reschedule your appointment.'),
('d0000000-0000-4000-8000-00000000d003', 'b1000000-0000-4000-8000-000000000001', 'deposits',
 'Whitening treatments need a $100 deposit when booking, taken off the final price.'),
('d0000000-0000-4000-8000-00000000d101', 'b2000000-0000-4000-8000-000000000002', 'cancellation',
 'Cancel up to 4 hours before your appointment at no charge; no-shows are charged the full price.'),
('d0000000-0000-4000-8000-00000000d102', 'b2000000-0000-4000-8000-000000000002', 'refunds',
 'If you are unhappy with a service, tell us within 7 days and we will fix it for free.')
ON CONFLICT (id) DO NOTHING;

INSERT INTO faqs (id, business_id, question, answer, tags)
VALUES
('e0000000-0000-4000-8000-00000000e001', 'b1000000-0000-4000-8000-000000000001',
 'Is there parking available?', 'Yes, there is free parking behind the clinic, entered from Lane Street.',
 ARRAY['parking', 'location']),
('e0000000-0000-4000-8000-00000000e002', 'b1000000-0000-4000-8000-000000000001',
 'Do you take health fund cards?', 'Yes, we claim on the spot for all major health funds.',
 ARRAY['payment', 'pricing']),
('e0000000-0000-4000-8000-00000000e101', 'b2000000-0000-4000-8000-000000000002',
 'Is there parking available?', 'Street parking is free after 6 pm; the Harbour car park is two minutes away.',
 ARRAY['parking', 'location'])
ON CONFLICT (id) DO NOTHING;

INSERT INTO customers (business_id, id, name, phone, email)
VALUES
('b1000000-0000-4000-8000-000000000001', 'cust_001', 'Sarah Mitchell', '+61400111222', 'sarah@example.com'),
('b1000000-0000-4000-8000-000000000001', 'cust_002', 'James Okafor', '+61400333444', 'james@example.com'),
('b1000000-0000-4000-8000-000000000001', 'cust_003', 'Priya Raman', '+61400555666', NULL),
('b2000000-0000-4000-8000-000000000002', 'cust_101', 'Sarah Mitchell', '+61400111222', 'sarah@example.com')
ON CONFLICT (business_id, id) DO NOTHING;

WITH local_day AS (
    SELECT date_trunc('day', now() AT TIME ZONE 'Australia/Sydney') AS today
)
INSERT INTO appointments (id, business_id, customer_id, service, location, starts_at, duration_minutes, status)
SELECT v.id, v.business_id::uuid, v.customer_id, v.service, v.location,
       (local_day.today + v.offset_local::interval) AT TIME ZONE 'Australia/Sydney', v.duration_minutes, v.status
FROM local_day, (VALUES
    ('appt_001', 'b1000000-0000-4000-8000-000000000001', 'cust_001', 'dental cleaning', 'Main Street clinic', '2 days 14 hours', 45, 'scheduled'),
    ('appt_002', 'b1000000-0000-4000-8000-000000000001', 'cust_001', 'follow-up consultation', 'Main Street clinic', '11 days 9 hours 30 minutes', 30, 'scheduled'),
    ('appt_000', 'b1000000-0000-4000-8000-000000000001', 'cust_001', 'check-up', 'Main Street clinic', '-20 days -14 hours', 30, 'completed'),
    ('appt_101', 'b1000000-0000-4000-8000-000000000001', 'cust_002', 'physiotherapy session', 'Harbour Road clinic', '5 days 16 hours 15 minutes', 60, 'scheduled'),
    ('appt_901', 'b2000000-0000-4000-8000-000000000002', 'cust_101', 'women''s cut and blow-dry', 'Harbour Hair Studio', '10 days 14 hours', 60, 'scheduled')
) AS v(id, business_id, customer_id, service, location, offset_local, duration_minutes, status)
ON CONFLICT (id) DO NOTHING;

WITH local_day AS (
    SELECT (now() AT TIME ZONE 'Australia/Sydney')::date AS today
)
INSERT INTO invoices (id, business_id, customer_id, amount_cents, currency, due_date, description, status)
SELECT v.id, v.business_id::uuid, v.customer_id, v.amount_cents, v.currency, local_day.today + v.due_in_days,
       v.description, v.status
FROM local_day, (VALUES
    ('inv_001', 'b1000000-0000-4000-8000-000000000001', 'cust_001', 15000, 'USD', 8, 'Dental cleaning', 'open'),
    ('inv_000', 'b1000000-0000-4000-8000-000000000001', 'cust_001', 9000, 'USD', -25, 'Check-up', 'paid'),
    ('inv_101', 'b1000000-0000-4000-8000-000000000001', 'cust_002', 8000, 'USD', 3, 'Physiotherapy', 'open'),
    ('inv_102', 'b1000000-0000-4000-8000-000000000001', 'cust_002', 12050, 'USD', 17, 'Assessment', 'open'),
    ('inv_901', 'b2000000-0000-4000-8000-000000000002', 'cust_101', 9500, 'AUD', 12, 'Cut and blow-dry', 'open')
) AS v(id, business_id, customer_id, amount_cents, currency, due_in_days, description, status)
ON CONFLICT (id) DO NOTHING;
