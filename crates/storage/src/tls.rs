//! TLS client settings of imports and registry pulls: rustls (ring provider) with the
//! system's root certificates plus the PEM bundles of the request (CDI's `certConfigMap`:
//! every value of the ConfigMap is a PEM bundle of CAs), or, only when a DataVolume sets
//! `insecureSkipVerify`, a configuration that accepts any server certificate.

use std::sync::Arc;

use rustls::DigitallySignedStruct;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};

use crate::error::StorageError;

/// Parse PEM bundles into DER certificates; a bundle without any certificate is an error.
pub fn parse_ca_pems(pems: &[String]) -> Result<Vec<CertificateDer<'static>>, StorageError> {
    use rustls::pki_types::pem::PemObject;
    let mut out = Vec::new();
    for (i, pem) in pems.iter().enumerate() {
        let certs: Vec<_> = CertificateDer::pem_slice_iter(pem.as_bytes())
            .collect::<Result<_, _>>()
            .map_err(|e| StorageError::invalid("CA certificate", format!("bundle {i}: {e}")))?;
        if certs.is_empty() {
            return Err(StorageError::invalid(
                "CA certificate",
                format!("bundle {i} holds no PEM CERTIFICATE block"),
            ));
        }
        out.extend(certs);
    }
    Ok(out)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A rustls client configuration trusting the system roots and the PEM bundles `ca_pems`.
pub fn tls_config(ca_pems: &[String]) -> Result<rustls::ClientConfig, StorageError> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for cert in native.certs {
        let _ = roots.add(cert);
    }
    for cert in parse_ca_pems(ca_pems)? {
        roots
            .add(cert)
            .map_err(|e| StorageError::invalid("CA certificate", e.to_string()))?;
    }
    Ok(rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| StorageError::invalid("TLS configuration", e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// A rustls client configuration that accepts any server certificate (still checking the
/// handshake signatures): `insecureSkipVerify`.
pub fn insecure_tls_config() -> Result<rustls::ClientConfig, StorageError> {
    let provider = provider();
    Ok(
        rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| StorageError::invalid("TLS configuration", e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
            .with_no_client_auth(),
    )
}

/// Accepts every certificate chain and host name.
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
