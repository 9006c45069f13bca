#include "security/hmac.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdlib>

namespace karat::security {

std::string HmacSha256(const std::string& key, const std::string& data) {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(data.data()), data.size(),
           out, &len) == nullptr)
    abort();
  return std::string(reinterpret_cast<const char*>(out), len);
}

bool ConstantTimeEqual(const std::string& a, const std::string& b) {
  return a.size() == b.size() &&
         CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

std::string RandomBytes(size_t n) {
  std::string out(n, '\0');
  if (n > 0 &&
      RAND_bytes(reinterpret_cast<unsigned char*>(out.data()),
                 static_cast<int>(n)) != 1)
    abort();
  return out;
}

}  // namespace karat::security
