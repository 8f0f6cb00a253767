//! `--datastore-endpoint` and its TLS flags (`--datastore-cafile`, `--datastore-certfile`,
//! `--datastore-keyfile`, k3s' names) parsed into a [`Datastore`]: SQLite at a path, or etcd
//! at a list of endpoints, plain or over TLS with an optional client certificate.
//!
//! Combinations that cannot mean what was asked are refused, never half-honoured: https
//! endpoints without a CA (there is no system trust store for etcd), a certificate without its
//! key or a key without its certificate, TLS files for plain-http etcd or for SQLite, and a mix
//! of http and https endpoints.

use std::path::{Path, PathBuf};

use crate::StoreError;

/// The TLS flags of a datastore (all optional; each a PEM file).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DatastoreTls {
    /// `--datastore-cafile`: the CA that signed the etcd members' serving certificates.
    pub ca_file: Option<PathBuf>,
    /// `--datastore-certfile`: this server's client certificate for etcd.
    pub cert_file: Option<PathBuf>,
    /// `--datastore-keyfile`: the key of `cert_file`.
    pub key_file: Option<PathBuf>,
}

impl DatastoreTls {
    fn any(&self) -> bool {
        self.ca_file.is_some() || self.cert_file.is_some() || self.key_file.is_some()
    }
}

/// The PEM contents of an etcd TLS configuration.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdTls {
    pub ca_pem: Vec<u8>,
    /// Client certificate and key, when the members require client certificates.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdTls")
            .field("client_certificate", &self.identity.is_some())
            .finish_non_exhaustive()
    }
}

/// What a `--datastore-endpoint` (with its TLS flags) names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Datastore {
    Sqlite(PathBuf),
    Etcd {
        endpoints: Vec<String>,
        /// The TLS files (paths; read by [`Datastore::read_tls`]) for https endpoints.
        tls: Option<DatastoreTls>,
    },
}

fn bad(msg: String) -> StoreError {
    StoreError::Backend(msg)
}

impl Datastore {
    /// Parses `endpoint` with its TLS flags (pure: reads no file).
    pub fn parse(
        endpoint: &str,
        tls: &DatastoreTls,
        data_dir: &Path,
    ) -> Result<Datastore, StoreError> {
        let endpoint = endpoint.trim();
        if let Some(rest) = endpoint
            .strip_prefix("sqlite://")
            .or_else(|| endpoint.strip_prefix("sqlite:"))
            .or(endpoint.is_empty().then_some(""))
        {
            if tls.any() {
                return Err(bad(
                    "--datastore-cafile/--datastore-certfile/--datastore-keyfile apply to etcd \
                     (https:// endpoints), not to SQLite"
                        .into(),
                ));
            }
            let path = rest.split('?').next().unwrap_or_default();
            return Ok(Datastore::Sqlite(if path.is_empty() {
                data_dir.join("state.db")
            } else {
                Path::new(path).to_path_buf()
            }));
        }
        if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
            return Err(bad(format!(
                "unsupported datastore endpoint {endpoint:?}: use sqlite://PATH or http(s)://HOST:PORT[,…]"
            )));
        }
        let endpoints: Vec<String> = endpoint
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(str::to_owned)
            .collect();
        if let Some(bad_one) = endpoints
            .iter()
            .find(|e| !e.starts_with("http://") && !e.starts_with("https://"))
        {
            return Err(bad(format!(
                "datastore endpoint {bad_one:?}: every etcd endpoint must start with http:// or https://"
            )));
        }
        let https = endpoints
            .iter()
            .filter(|e| e.starts_with("https://"))
            .count();
        if https > 0 && https < endpoints.len() {
            return Err(bad(
                "datastore endpoints mix http:// and https://: use one scheme for every etcd member"
                    .into(),
            ));
        }
        if https == 0 {
            if tls.any() {
                return Err(bad(
                    "--datastore-cafile/--datastore-certfile/--datastore-keyfile given, but the \
                     etcd endpoints are http://: use https:// endpoints (or drop the TLS flags)"
                        .into(),
                ));
            }
            return Ok(Datastore::Etcd {
                endpoints,
                tls: None,
            });
        }
        if tls.ca_file.is_none() {
            return Err(bad(
                "https:// etcd endpoints need --datastore-cafile (the CA of the members' certificates)"
                    .into(),
            ));
        }
        match (&tls.cert_file, &tls.key_file) {
            (Some(_), None) => {
                return Err(bad(
                    "--datastore-certfile needs --datastore-keyfile (the certificate's key)".into(),
                ));
            }
            (None, Some(_)) => {
                return Err(bad(
                    "--datastore-keyfile needs --datastore-certfile (the key's certificate)".into(),
                ));
            }
            _ => {}
        }
        Ok(Datastore::Etcd {
            endpoints,
            tls: Some(tls.clone()),
        })
    }

    /// Reads the TLS files named by `tls` (an error names the file and the flag).
    pub fn read_tls(tls: &DatastoreTls) -> Result<Option<EtcdTls>, StoreError> {
        let read = |p: &Path, flag: &str| -> Result<Vec<u8>, StoreError> {
            let b = std::fs::read(p).map_err(|e| bad(format!("{flag} {}: {e}", p.display())))?;
            if !String::from_utf8_lossy(&b).contains("-----BEGIN ") {
                return Err(bad(format!("{flag} {}: not a PEM file", p.display())));
            }
            Ok(b)
        };
        let Some(ca) = &tls.ca_file else {
            return Ok(None);
        };
        let ca_pem = read(ca, "--datastore-cafile")?;
        let identity = match (&tls.cert_file, &tls.key_file) {
            (Some(c), Some(k)) => Some((
                read(c, "--datastore-certfile")?,
                read(k, "--datastore-keyfile")?,
            )),
            _ => None,
        };
        Ok(Some(EtcdTls { ca_pem, identity }))
    }

    /// True for etcd (a datastore several servers can share).
    pub fn is_shared(&self) -> bool {
        matches!(self, Datastore::Etcd { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls(ca: bool, cert: bool, key: bool) -> DatastoreTls {
        DatastoreTls {
            ca_file: ca.then(|| "/ca.pem".into()),
            cert_file: cert.then(|| "/c.pem".into()),
            key_file: key.then(|| "/k.pem".into()),
        }
    }

    fn err(endpoint: &str, t: DatastoreTls) -> String {
        Datastore::parse(endpoint, &t, Path::new("/d"))
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn endpoints_and_refusals() {
        let none = DatastoreTls::default();
        assert_eq!(
            Datastore::parse("", &none, Path::new("/d")).unwrap(),
            Datastore::Sqlite("/d/state.db".into())
        );
        assert_eq!(
            Datastore::parse("sqlite:///x/db?mode=rwc", &none, Path::new("/d")).unwrap(),
            Datastore::Sqlite("/x/db".into())
        );
        let three = "https://a:2379, https://b:2379,https://c:2379";
        let d = Datastore::parse(three, &tls(true, true, true), Path::new("/d")).unwrap();
        assert_eq!(
            d,
            Datastore::Etcd {
                endpoints: vec![
                    "https://a:2379".into(),
                    "https://b:2379".into(),
                    "https://c:2379".into()
                ],
                tls: Some(tls(true, true, true)),
            }
        );
        assert!(d.is_shared());
        // A CA alone (server-authenticated TLS) is fine.
        Datastore::parse(three, &tls(true, false, false), Path::new("/d")).unwrap();
        assert!(err(three, none.clone()).contains("--datastore-cafile"));
        assert!(err(three, tls(true, true, false)).contains("needs --datastore-keyfile"));
        assert!(err(three, tls(true, false, true)).contains("needs --datastore-certfile"));
        assert!(err("http://a:2379", tls(true, false, false)).contains("are http://"));
        assert!(err("", tls(true, false, false)).contains("not to SQLite"));
        assert!(err("http://a:1,https://b:1", tls(true, false, false)).contains("mix"));
        assert!(err("http://a:1,b:1", none.clone()).contains("\"b:1\""));
        assert!(err("mysql://x", none).contains("unsupported"));
    }

    #[test]
    fn tls_files_are_read_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(
            &ca,
            "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let t = DatastoreTls {
            ca_file: Some(ca.clone()),
            ..Default::default()
        };
        let got = Datastore::read_tls(&t).unwrap().unwrap();
        assert!(got.identity.is_none());
        let t = DatastoreTls {
            ca_file: Some(ca.clone()),
            cert_file: Some(dir.path().join("missing.pem")),
            key_file: Some(ca.clone()),
        };
        let e = Datastore::read_tls(&t).unwrap_err().to_string();
        assert!(
            e.contains("--datastore-certfile") && e.contains("missing.pem"),
            "{e}"
        );
        std::fs::write(&ca, "garbage").unwrap();
        let t = DatastoreTls {
            ca_file: Some(ca),
            ..Default::default()
        };
        let e = Datastore::read_tls(&t).unwrap_err().to_string();
        assert!(e.contains("not a PEM file"), "{e}");
    }
}
