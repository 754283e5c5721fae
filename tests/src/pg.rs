//! A private PostgreSQL database for one test.
//!
//! [`TestDatabase::create`] creates a database with a unique name on the server of
//! `TOOLFLEET_TEST_DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`,
//! a user allowed to create databases and roles), applies the migrations and the demo
//! seed, and drops the database (`WITH (FORCE)`) when the value is dropped.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use toolfleet_packs::db::{self, DbConfig};

/// Server used when `TOOLFLEET_TEST_DATABASE_URL` is unset.
pub const DEFAULT_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// Bound of the setup steps and of the drop.
const PG_WAIT: Duration = Duration::from_secs(20);

/// The demo business "Bright Smile Dental".
pub const BUSINESS_A: &str = "b1000000-0000-4000-8000-000000000001";
/// The demo business "Harbour Hair Studio".
pub const BUSINESS_B: &str = "b2000000-0000-4000-8000-000000000002";
/// Sarah Mitchell's upcoming booking at business A.
pub const BOOKING_A: &str = "a0000000-0000-4000-8000-00000000a001";
/// Sarah Mitchell's booking at business B.
pub const BOOKING_B: &str = "b0000000-0000-4000-8000-00000000b001";
/// The caller with bookings at both businesses.
pub const CALLER_PHONE: &str = "+61400111222";

/// A database created for one test, dropped on `Drop`.
pub struct TestDatabase {
    name: String,
    url: String,
    admin_url: String,
}

impl std::fmt::Debug for TestDatabase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestDatabase")
            .field("name", &self.name)
            .finish()
    }
}

/// `url` with its database replaced by `name`.
fn with_database(url: &str, name: &str) -> Result<String> {
    let Some((scheme, rest)) = url.split_once("://") else {
        bail!("{url:?} is not a postgres:// URL");
    };
    let (authority, query) = match rest.split_once('?') {
        Some((a, q)) => (a, Some(q)),
        None => (rest, None),
    };
    let host = authority.split('/').next().unwrap_or(authority);
    let mut out = format!("{scheme}://{host}/{name}");
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    Ok(out)
}

impl TestDatabase {
    /// Creates, migrates and seeds a fresh database.
    pub async fn create() -> Result<Self> {
        let admin_url = std::env::var("TOOLFLEET_TEST_DATABASE_URL")
            .ok()
            .filter(|u| !u.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_ADMIN_URL.to_string());
        let name = format!(
            "toolfleet_test_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..16]
        );
        let url = with_database(&admin_url, &name)?;
        let admin = tokio::time::timeout(PG_WAIT, db::connect_admin(&admin_url))
            .await
            .context("connecting to PostgreSQL timed out")?
            .with_context(|| {
                format!(
                    "PostgreSQL at {admin_url} is needed for this test: apt-get install postgresql \
                     and start it, or set TOOLFLEET_TEST_DATABASE_URL to a server"
                )
            })?;
        admin
            .batch_execute(&format!("CREATE DATABASE {}", db::quote_ident(&name)))
            .await
            .with_context(|| format!("creating database {name}"))?;
        let database = Self {
            name,
            url,
            admin_url,
        };
        let mut client = database.admin().await?;
        tokio::time::timeout(PG_WAIT, db::migrate(&mut client))
            .await
            .context("migrations timed out")??;
        tokio::time::timeout(PG_WAIT, db::seed_demo(&mut client))
            .await
            .context("seeding timed out")??;
        Ok(database)
    }

    /// The database's URL (connecting as the server's admin user).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Tool-pack settings for this database: the read-only role and the default budget.
    pub fn db_config(&self) -> DbConfig {
        DbConfig::new(self.url.clone())
    }

    /// A connection to this database as the admin user, for changing data in a test.
    pub async fn admin(&self) -> Result<tokio_postgres::Client> {
        Ok(tokio::time::timeout(PG_WAIT, db::connect_admin(&self.url))
            .await
            .context("connecting to the test database timed out")??)
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        let sql = format!(
            "DROP DATABASE IF EXISTS {} WITH (FORCE)",
            db::quote_ident(&self.name)
        );
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        // A runtime of its own: Drop may run inside or outside a Tokio runtime.
        std::thread::spawn(move || {
            let outcome = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(anyhow::Error::from)
                .and_then(|rt| {
                    rt.block_on(async {
                        let client = tokio::time::timeout(PG_WAIT, db::connect_admin(&admin_url))
                            .await
                            .context("connect timed out")??;
                        tokio::time::timeout(PG_WAIT, client.batch_execute(&sql))
                            .await
                            .context("drop timed out")??;
                        Ok(())
                    })
                });
            let _ = done_tx.send(outcome);
        });
        match done_rx.recv_timeout(PG_WAIT + PG_WAIT) {
            Ok(Ok(())) => {}
            Ok(Err(error)) => eprintln!("could not drop test database {}: {error:#}", self.name),
            Err(_) => eprintln!("dropping test database {} timed out", self.name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_names_are_replaced() -> Result<()> {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1:5432/postgres", "x")?,
            "postgres://postgres@127.0.0.1:5432/x"
        );
        assert_eq!(
            with_database("postgres://u:p@h/db?sslmode=disable", "y")?,
            "postgres://u:p@h/y?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h", "z")?, "postgres://h/z");
        assert!(with_database("host=h", "z").is_err());
        Ok(())
    }
}
