// Certificates for the TLS tests, made with OpenSSL's API in a temporary folder: a CA, leaves
// it signs (with an IP subject-alternative name), leaves past their dates, a foreign CA.
#ifndef CXLKV_TESTS_SUPPORT_TEST_CERTS_H_
#define CXLKV_TESTS_SUPPORT_TEST_CERTS_H_

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <stdexcept>
#include <string>

#include "rpc/tls.h"

namespace cxlkv::testing {

// A folder for one test's PEM files, removed with it.
class CertDir {
 public:
  CertDir() {
    char tmpl[] = "/tmp/cxlkv_tls_test_XXXXXX";
    const char* p = ::mkdtemp(tmpl);
    if (p == nullptr) throw std::runtime_error("mkdtemp");
    path_ = p;
  }
  ~CertDir() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

class TestCert {
 public:
  TestCert(TestCert&& o) noexcept : key_(o.key_), cert_(o.cert_), cert_file_(o.cert_file_), key_file_(o.key_file_) {
    o.key_ = nullptr;
    o.cert_ = nullptr;
  }
  ~TestCert() {
    X509_free(cert_);
    EVP_PKEY_free(key_);
  }

  // A self-signed CA named `name`, its files in `dir`.
  static TestCert Ca(const std::string& dir, const std::string& name) { return Make(dir, name, nullptr, -60, 86400, true, ""); }
  // A leaf signed by this CA, valid from `from_s` to `to_s` seconds from now, naming `ip`.
  TestCert Leaf(const std::string& dir, const std::string& name, const std::string& ip = "127.0.0.1", long from_s = -60,
                long to_s = 86400) const {
    return Make(dir, name, this, from_s, to_s, false, ip);
  }

  const std::string& cert_file() const { return cert_file_; }
  const std::string& key_file() const { return key_file_; }
  // This certificate and key, trusting `ca`.
  rpc::TlsOptions Options(const TestCert& ca) const { return {cert_file_, key_file_, ca.cert_file_}; }

 private:
  TestCert() = default;

  static void Check(bool ok, const char* what) {
    if (!ok) throw std::runtime_error(std::string("test certificate: ") + what);
  }

  static void AddExtension(X509* x, X509V3_CTX* ctx, int nid, const std::string& value) {
    X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, ctx, nid, value.c_str());
    Check(ext != nullptr && X509_add_ext(x, ext, -1) == 1, "extension");
    X509_EXTENSION_free(ext);
  }

  static TestCert Make(const std::string& dir, const std::string& name, const TestCert* issuer, long from_s, long to_s,
                       bool is_ca, const std::string& ip) {
    static long serial = 1;
    TestCert c;
    c.key_ = EVP_EC_gen("P-256");
    Check(c.key_ != nullptr, "key");
    c.cert_ = X509_new();
    X509* x = c.cert_;
    Check(X509_set_version(x, 2) == 1 && ASN1_INTEGER_set(X509_get_serialNumber(x), serial++) == 1, "serial");
    Check(X509_gmtime_adj(X509_getm_notBefore(x), from_s) != nullptr && X509_gmtime_adj(X509_getm_notAfter(x), to_s) != nullptr,
          "dates");
    Check(X509_set_pubkey(x, c.key_) == 1, "public key");
    X509_NAME* subject = X509_get_subject_name(x);
    Check(X509_NAME_add_entry_by_txt(subject, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>(name.c_str()), -1,
                                     -1, 0) == 1,
          "name");
    Check(X509_set_issuer_name(x, issuer != nullptr ? X509_get_subject_name(issuer->cert_) : subject) == 1, "issuer");
    X509V3_CTX ctx;
    X509V3_set_ctx(&ctx, issuer != nullptr ? issuer->cert_ : x, x, nullptr, nullptr, 0);
    AddExtension(x, &ctx, NID_basic_constraints, is_ca ? "critical,CA:TRUE" : "CA:FALSE");
    AddExtension(x, &ctx, NID_subject_key_identifier, "hash");
    if (is_ca) AddExtension(x, &ctx, NID_key_usage, "critical,keyCertSign,cRLSign");
    if (issuer != nullptr) AddExtension(x, &ctx, NID_authority_key_identifier, "keyid");
    if (!ip.empty()) AddExtension(x, &ctx, NID_subject_alt_name, "IP:" + ip);
    Check(X509_sign(x, issuer != nullptr ? issuer->key_ : c.key_, EVP_sha256()) > 0, "sign");
    c.cert_file_ = dir + "/" + name + ".crt";
    c.key_file_ = dir + "/" + name + ".key";
    std::unique_ptr<FILE, int (*)(FILE*)> cf(std::fopen(c.cert_file_.c_str(), "w"), std::fclose);
    std::unique_ptr<FILE, int (*)(FILE*)> kf(std::fopen(c.key_file_.c_str(), "w"), std::fclose);
    Check(cf && kf && PEM_write_X509(cf.get(), x) == 1 &&
              PEM_write_PrivateKey(kf.get(), c.key_, nullptr, nullptr, 0, nullptr, nullptr) == 1,
          "write PEM");
    return c;
  }

  EVP_PKEY* key_ = nullptr;
  X509* cert_ = nullptr;
  std::string cert_file_, key_file_;
};

}  // namespace cxlkv::testing

#endif  // CXLKV_TESTS_SUPPORT_TEST_CERTS_H_
