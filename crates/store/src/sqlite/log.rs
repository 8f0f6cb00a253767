//! The SQL side of the SQLite backend: the schema of the revision log and every query on it.
//!
//! Storage is kine-shaped: one append-only table `kv_log` where each row is one write. Its
//! `id` (INTEGER PRIMARY KEY AUTOINCREMENT) is the write's revision; `create_revision` is the
//! revision that created the key, `prev_revision` the key's previous row (0: none) and `deleted`
//! marks a tombstone (which keeps the last value, so a delete event can carry it). A key's state
//! at revision R is its newest row with `id <= R`, unless that row is a tombstone. The current
//! revision is AUTOINCREMENT's high-water mark in `sqlite_sequence`, so it never goes back even
//! when compaction removes the newest row. `kv_meta` holds the compaction marker.
//!
//! Compaction at R keeps every row with `id > R` and, for each key, its newest row at or below
//! R unless that is a tombstone: enough to read at any revision >= R and to replay every event
//! after R, with the previous state of each.
//!
//! Every function here is synchronous and expects to run inside a transaction on the caller's
//! connection.

use rusqlite::{Connection, OptionalExtension, params};

use crate::{EventKind, KeyValue, ListOptions, ListResult, Revision, StoreError, WatchEvent};

/// Settings every connection gets (the writer and each reader): the query planner stability
/// guarantee (`SQLITE_DBCONFIG_ENABLE_QPSG`). The queries here are planned once, without
/// their parameters' values (the plans are the index ranges written into them). Without it,
/// SQLite marks a statement whose plan could depend on a bound value for recompilation
/// whenever its bindings are cleared, and rusqlite clears them each time a statement goes
/// back to its cache: every `latest`, list and watch read was parsed and planned again
/// (`sqlite3Reprepare`: 4 % of the idle server's CPU, docs/scale.md "Tenth pass").
pub(super) fn configure(conn: &Connection) -> Result<(), StoreError> {
    conn.set_db_config(
        rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG,
        true,
    )?;
    Ok(())
}

/// Creates the tables when they are missing.
pub(super) fn init_schema(conn: &Connection) -> Result<(), StoreError> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS kv_log (
             id INTEGER PRIMARY KEY AUTOINCREMENT,
             name BLOB NOT NULL,
             value BLOB NOT NULL,
             create_revision INTEGER NOT NULL,
             prev_revision INTEGER NOT NULL,
             deleted INTEGER NOT NULL
         );
         CREATE INDEX IF NOT EXISTS kv_log_name_id ON kv_log (name, id);
         CREATE TABLE IF NOT EXISTS kv_meta (
             name TEXT PRIMARY KEY,
             value INTEGER NOT NULL
         );
         INSERT OR IGNORE INTO kv_meta (name, value) VALUES ('schema_version', 1);
         INSERT OR IGNORE INTO kv_meta (name, value) VALUES ('compact_revision', 0);",
    )?;
    let version: i64 = conn.query_row(
        "SELECT value FROM kv_meta WHERE name = 'schema_version'",
        [],
        |r| r.get(0),
    )?;
    if version != 1 {
        return Err(StoreError::Backend(format!(
            "unsupported sqlite schema version {version} (this build knows version 1)"
        )));
    }
    Ok(())
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        StoreError::Backend(format!("sqlite: {e}"))
    }
}

/// The newest row of one key.
#[derive(Debug)]
pub(super) struct Row {
    pub id: Revision,
    pub value: Vec<u8>,
    pub create_revision: Revision,
    pub deleted: bool,
}

impl Row {
    fn into_kv(self, key: &str) -> KeyValue {
        KeyValue {
            key: key.to_owned(),
            value: self.value,
            create_revision: self.create_revision,
            mod_revision: self.id,
        }
    }
}

fn key_string(name: Vec<u8>) -> Result<String, StoreError> {
    String::from_utf8(name)
        .map_err(|_| StoreError::Backend("sqlite: stored key is not UTF-8".into()))
}

/// The latest revision (0 before the first write).
pub(super) fn current_revision(conn: &Connection) -> Result<Revision, StoreError> {
    let seq: Option<i64> = conn
        .prepare_cached("SELECT seq FROM sqlite_sequence WHERE name = 'kv_log'")?
        .query_row([], |r| r.get(0))
        .optional()?;
    Ok(seq.unwrap_or(0))
}

/// The compaction marker (0 when never compacted).
pub(super) fn compacted_revision(conn: &Connection) -> Result<Revision, StoreError> {
    Ok(conn
        .prepare_cached("SELECT value FROM kv_meta WHERE name = 'compact_revision'")?
        .query_row([], |r| r.get(0))?)
}

/// The newest row of a key.
pub(super) const LATEST: &str = "SELECT id, value, create_revision, deleted FROM kv_log
         WHERE name = ?1 ORDER BY id DESC LIMIT 1";

/// The newest row of `key`, tombstone or not.
pub(super) fn latest(conn: &Connection, key: &str) -> Result<Option<Row>, StoreError> {
    let mut stmt = conn.prepare_cached(LATEST)?;
    Ok(stmt
        .query_row(params![key.as_bytes()], |r| {
            Ok(Row {
                id: r.get(0)?,
                value: r.get(1)?,
                create_revision: r.get(2)?,
                deleted: r.get(3)?,
            })
        })
        .optional()?)
}

/// The current state of `key` (None: absent or deleted).
pub(super) fn get(conn: &Connection, key: &str) -> Result<Option<KeyValue>, StoreError> {
    Ok(latest(conn, key)?
        .filter(|row| !row.deleted)
        .map(|row| row.into_kv(key)))
}

/// Appends one row at revision current+1 and returns that revision.
pub(super) fn append(
    conn: &Connection,
    key: &str,
    value: &[u8],
    create_revision: Option<Revision>,
    prev_revision: Revision,
    deleted: bool,
) -> Result<Revision, StoreError> {
    let id = current_revision(conn)? + 1;
    let create_revision = create_revision.unwrap_or(id);
    conn.prepare_cached(
        "INSERT INTO kv_log (id, name, value, create_revision, prev_revision, deleted)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute(params![
        id,
        key.as_bytes(),
        value,
        create_revision,
        prev_revision,
        deleted
    ])?;
    Ok(id)
}

/// Resolves the revision a read should use, failing for compacted or future revisions.
fn read_revision(conn: &Connection, requested: Option<Revision>) -> Result<Revision, StoreError> {
    let current = current_revision(conn)?;
    let Some(rev) = requested.filter(|r| *r > 0) else {
        return Ok(current);
    };
    let compacted = compacted_revision(conn)?;
    if rev < compacted {
        return Err(StoreError::Compacted {
            requested: rev,
            compacted,
        });
    }
    if rev > current {
        return Err(StoreError::Backend(format!(
            "revision {rev} is a future revision (current is {current})"
        )));
    }
    Ok(rev)
}

/// The key range a list reads (pure): from `prefix`, or from just after `start_after` when
/// that lies past it (the smallest key greater than `s` is `s` followed by a zero byte), up to
/// [`crate::prefix_end`] (none for a prefix that has no end: every key after it).
///
/// Both bounds go to SQLite as plain `name >= ?` / `name < ?` terms so that the planner
/// searches the `(name, id)` index over that range only. The earlier form, `(?2 IS NULL OR
/// name < ?2)`, gave it a lower bound only: every list read the index from the prefix to the
/// end of the table (a quota lookup per namespaced create scanned every VMI and Event
/// revision after `/registry/core/resourcequotas/`, docs/scale.md "Eighth pass").
pub(super) fn list_range(prefix: &[u8], start_after: Option<&[u8]>) -> (Vec<u8>, Option<Vec<u8>>) {
    let mut from = prefix.to_vec();
    if let Some(s) = start_after {
        let mut next = s.to_vec();
        next.push(0);
        if next > from {
            from = next;
        }
    }
    (from, crate::prefix_end(prefix))
}

/// The latest row of each key in `[from, end)` at revision `revision`, in key order; `end`
/// `None`: to the end of the key space.
pub(super) const LIST_BOUNDED: &str = "SELECT r.id, r.name, r.value, r.create_revision
         FROM kv_log r
         JOIN (SELECT MAX(id) AS mid FROM kv_log
               WHERE name >= ?1 AND name < ?2 AND id <= ?3
               GROUP BY name) m ON r.id = m.mid
         WHERE r.deleted = 0
         ORDER BY r.name
         LIMIT ?4";
const LIST_UNBOUNDED: &str = "SELECT r.id, r.name, r.value, r.create_revision
         FROM kv_log r
         JOIN (SELECT MAX(id) AS mid FROM kv_log
               WHERE name >= ?1 AND ?2 IS NULL AND id <= ?3
               GROUP BY name) m ON r.id = m.mid
         WHERE r.deleted = 0
         ORDER BY r.name
         LIMIT ?4";

/// Keys under `prefix` as of `opts.revision`, in key order.
pub(super) fn list(
    conn: &Connection,
    prefix: &str,
    opts: &ListOptions,
) -> Result<ListResult, StoreError> {
    let revision = read_revision(conn, opts.revision)?;
    let (from, end) = list_range(
        prefix.as_bytes(),
        opts.start_after.as_ref().map(|s| s.as_bytes()),
    );
    let limit = opts.limit.filter(|l| *l > 0);
    // One more than asked, to learn whether more keys follow.
    let sql_limit: i64 = limit.map_or(-1, |l| i64::try_from(l).unwrap_or(i64::MAX - 1) + 1);
    let mut stmt = conn.prepare_cached(if end.is_some() {
        LIST_BOUNDED
    } else {
        LIST_UNBOUNDED
    })?;
    let rows = stmt.query_map(params![from, end, revision, sql_limit], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, Vec<u8>>(1)?,
            r.get::<_, Vec<u8>>(2)?,
            r.get::<_, i64>(3)?,
        ))
    })?;
    let mut items = Vec::new();
    for row in rows {
        let (id, name, value, create_revision) = row?;
        items.push(KeyValue {
            key: key_string(name)?,
            value,
            create_revision,
            mod_revision: id,
        });
    }
    let more = limit.is_some_and(|l| items.len() > l);
    if let Some(l) = limit {
        items.truncate(l);
    }
    Ok(ListResult {
        items,
        revision,
        more,
    })
}

/// Rows after a revision under a key range, each with the row it replaced.
pub(super) const EVENTS_AFTER: &str = "SELECT r.id, r.name, r.value, r.create_revision, r.deleted,
                p.id, p.value, p.create_revision
         FROM kv_log r LEFT JOIN kv_log p ON p.id = r.prev_revision
         WHERE r.id > ?1 AND r.name >= ?2 AND (?3 IS NULL OR r.name < ?3)
         ORDER BY r.id
         LIMIT ?4";

/// Up to `max` events under `prefix` with revision greater than `after`, oldest first.
/// Fails with `Compacted` when `after` is older than the compacted revision.
pub(super) fn events_after(
    conn: &Connection,
    prefix: &str,
    after: Revision,
    max: usize,
) -> Result<Vec<WatchEvent>, StoreError> {
    let compacted = compacted_revision(conn)?;
    if after < compacted {
        return Err(StoreError::Compacted {
            requested: after,
            compacted,
        });
    }
    let end = crate::prefix_end(prefix.as_bytes());
    let mut stmt = conn.prepare_cached(EVENTS_AFTER)?;
    let rows = stmt.query_map(
        params![
            after,
            prefix.as_bytes(),
            end,
            i64::try_from(max).unwrap_or(i64::MAX)
        ],
        |r| {
            let prev = match r.get::<_, Option<i64>>(5)? {
                Some(id) => Some((id, r.get::<_, Vec<u8>>(6)?, r.get::<_, i64>(7)?)),
                None => None,
            };
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, Vec<u8>>(1)?,
                r.get::<_, Vec<u8>>(2)?,
                r.get::<_, i64>(3)?,
                r.get::<_, bool>(4)?,
                prev,
            ))
        },
    )?;
    let mut events = Vec::new();
    for row in rows {
        let (id, name, value, create_revision, deleted, prev) = row?;
        let key = key_string(name)?;
        let kind = if deleted {
            EventKind::Deleted
        } else if create_revision == id {
            EventKind::Created
        } else {
            EventKind::Modified
        };
        let prev = match kind {
            EventKind::Created => None,
            _ => prev.map(|(pid, pvalue, pcreate)| KeyValue {
                key: key.clone(),
                value: pvalue,
                create_revision: pcreate,
                mod_revision: pid,
            }),
        };
        events.push(WatchEvent {
            kind,
            revision: id,
            kv: KeyValue {
                key,
                value,
                create_revision,
                mod_revision: id,
            },
            prev,
        });
    }
    Ok(events)
}

/// Moves the compaction marker to `revision` (never backwards). Returns the previous marker, or
/// None when there is nothing to do.
pub(super) fn set_compact_marker(
    conn: &Connection,
    revision: Revision,
) -> Result<Option<Revision>, StoreError> {
    let current = current_revision(conn)?;
    if revision > current {
        return Err(StoreError::Backend(format!(
            "cannot compact at future revision {revision} (current is {current})"
        )));
    }
    let old = compacted_revision(conn)?;
    if revision <= old {
        return Ok(None);
    }
    conn.execute(
        "UPDATE kv_meta SET value = ?1 WHERE name = 'compact_revision'",
        params![revision],
    )?;
    Ok(Some(old))
}

/// The smallest row id in the log (None when empty).
pub(super) fn first_id(conn: &Connection) -> Result<Option<Revision>, StoreError> {
    Ok(conn.query_row("SELECT MIN(id) FROM kv_log", [], |r| r.get(0))?)
}

/// Deletes the rows with `lo <= id < hi` that compaction at `revision` no longer needs.
pub(super) fn compact_range(
    conn: &Connection,
    revision: Revision,
    lo: Revision,
    hi: Revision,
) -> Result<usize, StoreError> {
    Ok(conn.execute(
        "DELETE FROM kv_log
         WHERE id >= ?1 AND id < ?2 AND id <= ?3
           AND (deleted = 1
                OR id < (SELECT MAX(k.id) FROM kv_log k
                         WHERE k.name = kv_log.name AND k.id <= ?3))",
        params![lo, hi, revision],
    )?)
}
