//! Stream tokens: short-lived, turn-scoped credentials for a browser's `EventSource`,
//! which cannot send an `Authorization` header.
//!
//! Owns minting a token for one turn of one key's tenant and checking it. A token is
//! `tfs_` + hex(`v1|<expiry unix s>|<turn id>|<key id>|<tenant>`) + `_` + hex(HMAC-SHA256
//! of those bytes under the gateway's stream-token secret). It names one turn and reads
//! only that turn's events (`GET /v1/turns/{turn_id}/events?token=…`): it cannot submit,
//! cancel, read another turn or the catalog, and it stops working at its expiry. The
//! API key itself never appears in a URL. Checking a token asks no database: a token
//! minted before its key was revoked keeps reading its one turn until it expires.
//! Never logs a token.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// What every stream token starts with.
pub const TOKEN_PREFIX: &str = "tfs_";
/// The query parameter a stream token travels in.
pub const TOKEN_QUERY: &str = "token";
/// The response header of `POST /v1/turns` carrying a token for the turn.
pub const TOKEN_HEADER: &str = "toolfleet-stream-token";
/// The format version inside a token.
const VERSION: &str = "v1";
/// SHA-256's block size, HMAC's key block.
const BLOCK: usize = 64;

/// The secret stream tokens are signed with. Its `Debug` never shows it.
#[derive(Clone)]
pub struct TokenSecret(Vec<u8>);

impl TokenSecret {
    /// A secret from configured text (`TOOLFLEET_GATEWAY_STREAM_TOKEN_SECRET`).
    pub fn new(text: &str) -> Self {
        Self(text.as_bytes().to_vec())
    }

    /// A fresh random secret (244 random bits from two v4 UUIDs): tokens then work only
    /// on the gateway process that minted them.
    pub fn random() -> Self {
        let mut bytes = uuid::Uuid::new_v4().as_bytes().to_vec();
        bytes.extend_from_slice(uuid::Uuid::new_v4().as_bytes());
        Self(bytes)
    }
}

impl std::fmt::Debug for TokenSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenSecret(***)")
    }
}

/// What a valid token grants: reading the events of `turn_id` for `tenant`, as key
/// `key_id` (whose rate the reads spend).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The one turn the token reads.
    pub turn_id: String,
    /// The key that minted it.
    pub key_id: String,
    /// The key's tenant.
    pub tenant: String,
    /// Expiry, seconds since the Unix epoch.
    pub expires_at: u64,
}

/// Why a token was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Not a token of this gateway (malformed, or a signature that does not match).
    #[error("the stream token is not valid")]
    Invalid,
    /// Valid once, past its expiry now.
    #[error("the stream token has expired")]
    Expired,
    /// Valid, for another turn.
    #[error("the stream token is for another turn")]
    OtherTurn,
}

/// Mints and checks stream tokens under one secret.
#[derive(Debug, Clone)]
pub struct StreamTokens {
    secret: TokenSecret,
    /// Shortest life of a token (`TOOLFLEET_GATEWAY_STREAM_TOKEN_TTL_MS`).
    pub ttl: Duration,
}

impl StreamTokens {
    /// Tokens signed with `secret` living at least `ttl`.
    pub fn new(secret: TokenSecret, ttl: Duration) -> Self {
        Self { secret, ttl }
    }

    /// A token for `grant` (its `expires_at` included).
    pub fn mint(&self, grant: &Grant) -> String {
        let payload = format!(
            "{VERSION}|{}|{}|{}|{}",
            grant.expires_at, grant.turn_id, grant.key_id, grant.tenant
        );
        let mac = hmac(&self.secret.0, payload.as_bytes());
        format!("{TOKEN_PREFIX}{}_{}", hex(payload.as_bytes()), hex(&mac))
    }

    /// The grant for `turn_id`, expiring `life` from now (at least the configured TTL).
    pub fn grant(&self, turn_id: &str, key_id: &str, tenant: &str, life: Duration) -> Grant {
        Grant {
            turn_id: turn_id.to_string(),
            key_id: key_id.to_string(),
            tenant: tenant.to_string(),
            expires_at: now_s().saturating_add(life.max(self.ttl).as_secs().max(1)),
        }
    }

    /// What `token` grants for reading `turn_id` at `now_s` (seconds since the epoch).
    pub fn check_at(&self, token: &str, turn_id: &str, now_s: u64) -> Result<Grant, TokenError> {
        let body = token
            .strip_prefix(TOKEN_PREFIX)
            .ok_or(TokenError::Invalid)?;
        let (payload_hex, mac_hex) = body.split_once('_').ok_or(TokenError::Invalid)?;
        let payload = unhex(payload_hex).ok_or(TokenError::Invalid)?;
        let mac = unhex(mac_hex).ok_or(TokenError::Invalid)?;
        if !same(&hmac(&self.secret.0, &payload), &mac) {
            return Err(TokenError::Invalid);
        }
        let text = std::str::from_utf8(&payload).map_err(|_| TokenError::Invalid)?;
        let mut fields = text.splitn(5, '|');
        let (Some(VERSION), Some(expiry), Some(turn), Some(key_id), Some(tenant)) = (
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
        ) else {
            return Err(TokenError::Invalid);
        };
        let expires_at: u64 = expiry.parse().map_err(|_| TokenError::Invalid)?;
        if now_s >= expires_at {
            return Err(TokenError::Expired);
        }
        if turn != turn_id {
            return Err(TokenError::OtherTurn);
        }
        Ok(Grant {
            turn_id: turn.to_string(),
            key_id: key_id.to_string(),
            tenant: tenant.to_string(),
            expires_at,
        })
    }

    /// What `token` grants for reading `turn_id` now.
    pub fn check(&self, token: &str, turn_id: &str) -> Result<Grant, TokenError> {
        self.check_at(token, turn_id, now_s())
    }
}

/// A stream token for one turn.
#[derive(Debug, Clone, Serialize, Deserialize, JsonSchema)]
pub struct StreamToken {
    /// The turn the token reads.
    pub turn_id: String,
    /// The token (`tfs_…`): reads this turn's events only, until `expires_at`.
    pub token: String,
    /// When the token stops working, seconds since the Unix epoch.
    pub expires_at: u64,
    /// The path an `EventSource` opens: `/v1/turns/{turn_id}/events?token=…`.
    pub events_url: String,
}

impl StreamToken {
    /// A token of `tokens` for `turn_id`, minted by `key_id` of `tenant`, living at
    /// least `life`.
    pub fn mint(
        tokens: &StreamTokens,
        turn_id: &str,
        key_id: &str,
        tenant: &str,
        life: Duration,
    ) -> Self {
        let grant = tokens.grant(turn_id, key_id, tenant, life);
        let token = tokens.mint(&grant);
        Self {
            turn_id: turn_id.to_string(),
            events_url: format!("/v1/turns/{turn_id}/events?token={token}"),
            token,
            expires_at: grant.expires_at,
        }
    }
}

/// Seconds since the Unix epoch.
pub fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// HMAC-SHA256 (RFC 2104) of `message` under `key`.
fn hmac(key: &[u8], message: &[u8]) -> [u8; 32] {
    let mut block = [0u8; BLOCK];
    if key.len() > BLOCK {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let pad = |byte: u8| block.map(|b| b ^ byte);
    let inner = Sha256::new()
        .chain_update(pad(0x36))
        .chain_update(message)
        .finalize();
    Sha256::new()
        .chain_update(pad(0x5c))
        .chain_update(inner)
        .finalize()
        .into()
}

/// Whether `a` and `b` are equal, in time that does not depend on where they differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || text.len() > 4096 {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(secret: &str) -> StreamTokens {
        StreamTokens::new(TokenSecret::new(secret), Duration::from_secs(60))
    }

    #[test]
    fn hmac_matches_rfc_4231_case_2() {
        let mac = hmac(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(
            hex(&mac),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        let long_key = [0xaau8; 131];
        let mac = hmac(
            &long_key,
            b"Test Using Larger Than Block-Size Key - Hash Key First",
        );
        assert_eq!(
            hex(&mac),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn a_token_reads_its_own_turn_until_it_expires() {
        let t = tokens("s3cret");
        let grant = Grant {
            turn_id: "t-1".into(),
            key_id: "k1".into(),
            tenant: "acme|odd".into(),
            expires_at: 1_000,
        };
        let token = t.mint(&grant);
        assert!(token.starts_with(TOKEN_PREFIX));
        assert_eq!(t.check_at(&token, "t-1", 999), Ok(grant));
        assert_eq!(t.check_at(&token, "t-1", 1_000), Err(TokenError::Expired));
        assert_eq!(t.check_at(&token, "t-2", 10), Err(TokenError::OtherTurn));
        assert_eq!(
            tokens("other").check_at(&token, "t-1", 10),
            Err(TokenError::Invalid)
        );
    }

    #[test]
    fn a_changed_token_is_refused() {
        let t = tokens("s3cret");
        let token = t.mint(&t.grant("t-1", "k1", "acme", Duration::from_secs(5)));
        // Another tenant written into the payload, the signature kept.
        let (payload, mac) = token
            .strip_prefix(TOKEN_PREFIX)
            .and_then(|b| b.split_once('_'))
            .unwrap_or_default();
        let text = String::from_utf8(unhex(payload).unwrap_or_default()).unwrap_or_default();
        let forged = format!(
            "{TOKEN_PREFIX}{}_{mac}",
            hex(text.replace("acme", "globex").as_bytes())
        );
        assert_eq!(t.check(&forged, "t-1"), Err(TokenError::Invalid));
        for bad in [
            "",
            "tfs_",
            "tfs_zz_00",
            "tfk_abc",
            &token[..token.len() - 2],
        ] {
            assert_eq!(t.check(bad, "t-1"), Err(TokenError::Invalid), "{bad}");
        }
        assert!(t.check(&token, "t-1").is_ok());
    }

    #[test]
    fn a_grant_lives_at_least_the_configured_ttl() {
        let t = tokens("s");
        let short = t.grant("t", "k", "a", Duration::from_secs(1));
        assert!(short.expires_at >= now_s() + 59);
        let long = t.grant("t", "k", "a", Duration::from_secs(600));
        assert!(long.expires_at >= now_s() + 599);
        assert!(!format!("{t:?}").contains("s3cret"));
    }
}
