// mbert::TritonEmbedder over libcurl (one easy handle per client: its connection is kept alive and
// reused) and nlohmann-json. Protocol: KServe v2 HTTP with Triton's binary tensor data extension
// (docs/protocol/extension_binary_data.md in triton-inference-server/server).
#include "mbert/triton_embedder.hpp"

#include <curl/curl.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <utility>

namespace mbert {

namespace {

using json = nlohmann::json;

const char* const kInput = "TEXT";
const char* const kEmbedding = "sentence_embedding";
const char* const kNumTokens = "num_tokens";
const char* const kTruncated = "truncated";
const char* const kHeaderLength = "inference-header-content-length";
// A reply's text quoted in an error message is cut here (an HTML error page can be long).
const std::size_t kQuoted = 300;

void global_init() {
  // curl_global_init is not thread-safe in every libcurl build: run it once, before any handle.
  static std::once_flag once;
  static CURLcode code = CURLE_OK;
  std::call_once(once, [] { code = curl_global_init(CURL_GLOBAL_DEFAULT); });
  if (code != CURLE_OK) throw Error(ErrorKind::Connection, std::string("libcurl: ") + curl_easy_strerror(code));
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::string trim(const std::string& s) {
  const char* space = " \t\r\n";
  std::size_t a = s.find_first_not_of(space);
  if (a == std::string::npos) return "";
  return s.substr(a, s.find_last_not_of(space) - a + 1);
}

// What the server said: the `error` field of Triton's JSON error reply, else the reply's text.
std::string server_message(const std::string& body) {
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("error") && j["error"].is_string()) return j["error"].get<std::string>();
  std::string text = trim(body.substr(0, kQuoted));
  return text.empty() ? "(empty reply)" : text;
}

struct Reply {
  long status = 0;
  std::string body;
  long long header_length = -1;  // Inference-Header-Content-Length; -1: absent (the body is all JSON)
};

std::size_t on_body(char* data, std::size_t size, std::size_t n, void* user) {
  static_cast<Reply*>(user)->body.append(data, size * n);
  return size * n;
}

std::size_t on_header(char* data, std::size_t size, std::size_t n, void* user) {
  auto* reply = static_cast<Reply*>(user);
  std::string line(data, size * n);
  if (line.rfind("HTTP/", 0) == 0) reply->header_length = -1;  // a new status line: its own headers follow
  std::size_t colon = line.find(':');
  if (colon != std::string::npos && lower(trim(line.substr(0, colon))) == kHeaderLength) {
    std::string value = trim(line.substr(colon + 1));
    char* end = nullptr;
    long long v = std::strtoll(value.c_str(), &end, 10);
    reply->header_length = (!value.empty() && end && *end == '\0' && v >= 0) ? v : -2;  // -2: unreadable
  }
  return size * n;
}

// http(s)://HOST[:PORT] from `url` (a trailing "/" allowed); Error(InvalidUrl) naming what is wrong.
std::string base_url(const std::string& url) {
  std::unique_ptr<CURLU, decltype(&curl_url_cleanup)> h(curl_url(), curl_url_cleanup);
  if (!h) throw Error(ErrorKind::InvalidUrl, "out of memory parsing the URL");
  auto bad = [&](const std::string& why) {
    return Error(ErrorKind::InvalidUrl, "bad URL \"" + url + "\": " + why + " (expected http://HOST:PORT)");
  };
  CURLUcode rc = curl_url_set(h.get(), CURLUPART_URL, url.c_str(), 0);
  if (rc != CURLUE_OK) throw bad(curl_url_strerror(rc));
  auto part = [&](CURLUPart which) {
    char* value = nullptr;
    std::string out;
    if (curl_url_get(h.get(), which, &value, 0) == CURLUE_OK && value) out = value;
    curl_free(value);
    return out;
  };
  std::string scheme = lower(part(CURLUPART_SCHEME)), host = part(CURLUPART_HOST), port = part(CURLUPART_PORT);
  std::string path = part(CURLUPART_PATH);
  if (scheme != "http" && scheme != "https") throw bad("scheme \"" + scheme + "\" is not http or https");
  if (host.empty()) throw bad("no host");
  if (!(path.empty() || path == "/") || !part(CURLUPART_QUERY).empty() || !part(CURLUPART_FRAGMENT).empty())
    throw bad("a path, query or fragment is not allowed");
  return scheme + "://" + host + (port.empty() ? "" : ":" + port);
}

// --- decoding one output tensor ----------------------------------------------------------------

struct Tensor {
  std::string datatype;
  std::vector<long long> shape;
  const json* data = nullptr;         // the JSON `data` array, or
  const char* binary = nullptr;       // the raw bytes after the JSON header
  std::size_t binary_size = 0;
};

std::size_t element_size(const std::string& datatype) {
  if (datatype == "FP32") return 4;
  if (datatype == "INT64") return 8;
  if (datatype == "BOOL") return 1;
  return 0;
}

template <typename T>
T read_le(const char* p) {  // little-endian, whatever the host's order
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) v |= std::uint64_t(static_cast<unsigned char>(p[i])) << (8 * i);
  if constexpr (std::is_same_v<T, float>) {
    std::uint32_t bits = static_cast<std::uint32_t>(v);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  } else {
    return static_cast<T>(v);
  }
}

}  // namespace

const char* to_string(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::InvalidUrl: return "invalid URL";
    case ErrorKind::InvalidInput: return "invalid input";
    case ErrorKind::Connection: return "connection";
    case ErrorKind::Timeout: return "timeout";
    case ErrorKind::NotReady: return "model not ready";
    case ErrorKind::Http: return "HTTP error";
    case ErrorKind::MalformedResponse: return "malformed response";
  }
  return "error";
}

Error::Error(ErrorKind kind, const std::string& message, long http_status)
    : std::runtime_error(message), kind_(kind), http_status_(http_status) {}

struct TritonEmbedder::Impl {
  std::string url, model, model_path;
  long timeout_ms;
  CURL* curl = nullptr;
  char errors[CURL_ERROR_SIZE] = {0};
  bool ready = false;
  std::size_t max_batch = 0;

  Impl(const std::string& u, std::string m, std::chrono::milliseconds timeout)
      : url(base_url(u)), model(std::move(m)), timeout_ms(static_cast<long>(timeout.count())) {
    if (model.empty()) throw Error(ErrorKind::InvalidInput, "the model name is empty");
    if (timeout_ms <= 0) throw Error(ErrorKind::InvalidInput, "the timeout must be positive");
    global_init();
    curl = curl_easy_init();
    if (!curl) throw Error(ErrorKind::Connection, "curl_easy_init failed");
    char* escaped = curl_easy_escape(curl, model.c_str(), static_cast<int>(model.size()));
    model_path = std::string("/v2/models/") + (escaped ? escaped : model.c_str());
    curl_free(escaped);
    curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);  // no SIGALRM for timeouts: safe beside other threads
    curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_easy_setopt(curl, CURLOPT_CONNECTTIMEOUT_MS, timeout_ms);
    curl_easy_setopt(curl, CURLOPT_ERRORBUFFER, errors);
    curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(curl, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(curl, CURLOPT_TCP_NODELAY, 1L);
  }

  ~Impl() {
    if (curl) curl_easy_cleanup(curl);
  }

  std::string where() const { return "Triton at " + url + ", model '" + model + "'"; }

  // One HTTP request (GET, or POST of `body` whose JSON header is `header_length` bytes).
  Reply request(const std::string& path, const std::string& what, const std::string* body = nullptr,
                std::size_t header_length = 0) {
    Reply reply;
    curl_easy_setopt(curl, CURLOPT_URL, (url + path).c_str());
    curl_easy_setopt(curl, CURLOPT_WRITEDATA, &reply);
    curl_easy_setopt(curl, CURLOPT_HEADERDATA, &reply);
    std::unique_ptr<curl_slist, decltype(&curl_slist_free_all)> headers(nullptr, curl_slist_free_all);
    if (body) {
      curl_slist* h = curl_slist_append(nullptr, "Content-Type: application/octet-stream");
      h = curl_slist_append(h, ("Inference-Header-Content-Length: " + std::to_string(header_length)).c_str());
      h = curl_slist_append(h, "Expect:");  // no 100-continue round trip before large bodies
      headers.reset(h);
      curl_easy_setopt(curl, CURLOPT_POST, 1L);
      curl_easy_setopt(curl, CURLOPT_POSTFIELDS, body->data());
      curl_easy_setopt(curl, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body->size()));
    } else {
      curl_easy_setopt(curl, CURLOPT_HTTPGET, 1L);
    }
    curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers.get());
    errors[0] = '\0';
    CURLcode rc = curl_easy_perform(curl);
    curl_easy_setopt(curl, CURLOPT_HTTPHEADER, nullptr);
    if (rc != CURLE_OK) {
      std::string detail = errors[0] ? errors : curl_easy_strerror(rc);
      if (rc == CURLE_OPERATION_TIMEDOUT)
        throw Error(ErrorKind::Timeout, where() + ": no answer to " + what + " within " +
                                            std::to_string(timeout_ms) + " ms (" + detail + ")");
      throw Error(ErrorKind::Connection, where() + ": " + what + " failed: " + detail);
    }
    curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &reply.status);
    return reply;
  }

  [[noreturn]] void malformed(const std::string& what, const std::string& why) const {
    throw Error(ErrorKind::MalformedResponse, where() + ": unreadable reply to " + what + ": " + why);
  }

  void check_ready() {
    if (ready) return;
    Reply r = request(model_path + "/ready", "a readiness check");
    if (r.status != 200) {
      // the ready endpoint says only "Model version not ready"; the model's metadata says why
      Reply meta = request(model_path, "a metadata request");
      std::string why = server_message(meta.status != 200 ? meta.body : r.body);
      throw Error(ErrorKind::NotReady, where() + " is not ready: " + why, r.status);
    }
    ready = true;
  }

  void read_config() {
    if (max_batch) return;
    check_ready();
    const std::string what = "the model's config request";
    Reply r = request(model_path + "/config", what);
    if (r.status != 200)
      throw Error(ErrorKind::Http, where() + ": config refused (HTTP " + std::to_string(r.status) + "): " +
                                       server_message(r.body), r.status);
    json config = json::parse(r.body, nullptr, false);
    if (!config.is_object()) malformed(what, "not a JSON object");
    auto names = [&](const char* key) {
      std::vector<std::string> out;
      if (config.contains(key) && config[key].is_array())
        for (const auto& t : config[key])
          if (t.is_object() && t.contains("name") && t["name"].is_string()) out.push_back(t["name"]);
      return out;
    };
    std::vector<std::string> inputs = names("input"), outputs = names("output");
    if (inputs != std::vector<std::string>{kInput} ||
        std::find(outputs.begin(), outputs.end(), kEmbedding) == outputs.end())
      throw Error(ErrorKind::NotReady, where() + " is not a bundle's ensemble: it must take TEXT and return " +
                                           kEmbedding + " (it takes " + json(inputs).dump() + ")");
    long long batch = config.value("max_batch_size", 0LL);
    if (batch <= 0) throw Error(ErrorKind::NotReady, where() + " does not batch (max_batch_size 0)");
    max_batch = static_cast<std::size_t>(batch);
  }

  void infer(const std::string* begin, std::size_t n, Embeddings& out);
};

void TritonEmbedder::Impl::infer(const std::string* texts, std::size_t n, Embeddings& out) {
  const std::string what = "a request of " + std::to_string(n) + (n == 1 ? " text" : " texts");
  // TEXT as one BYTES tensor [n, 1] in binary: per text a 4-byte little-endian length, then its bytes
  std::string binary;
  for (std::size_t i = 0; i < n; ++i) {
    std::uint64_t size = texts[i].size();
    if (size > std::numeric_limits<std::uint32_t>::max())
      throw Error(ErrorKind::InvalidInput, "text of " + std::to_string(size) + " bytes: over 4 GiB");
    for (int b = 0; b < 4; ++b) binary.push_back(static_cast<char>((size >> (8 * b)) & 0xff));
    binary += texts[i];
  }
  json header = {
      {"inputs", json::array({{{"name", kInput},
                               {"shape", {n, 1}},
                               {"datatype", "BYTES"},
                               {"parameters", {{"binary_data_size", binary.size()}}}}})},
      {"outputs", json::array({{{"name", kEmbedding}, {"parameters", {{"binary_data", true}}}},
                               {{"name", kNumTokens}, {"parameters", {{"binary_data", false}}}},
                               {{"name", kTruncated}, {"parameters", {{"binary_data", false}}}}})}};
  std::string body = header.dump();
  std::size_t header_size = body.size();
  body += binary;
  Reply r = request(model_path + "/infer", what, &body, header_size);
  if (r.status != 200)
    throw Error(ErrorKind::Http, where() + " refused " + what + " (HTTP " + std::to_string(r.status) + "): " +
                                     server_message(r.body), r.status);

  // the JSON header, then each binary output's bytes in the order of `outputs`
  if (r.header_length == -2) malformed(what, "unreadable Inference-Header-Content-Length");
  std::size_t json_size = r.header_length < 0 ? r.body.size() : static_cast<std::size_t>(r.header_length);
  if (json_size > r.body.size())
    malformed(what, "Inference-Header-Content-Length " + std::to_string(json_size) + " > body of " +
                        std::to_string(r.body.size()) + " bytes");
  json reply = json::parse(r.body.begin(), r.body.begin() + static_cast<std::ptrdiff_t>(json_size), nullptr, false);
  if (!reply.is_object() || !reply.contains("outputs") || !reply["outputs"].is_array())
    malformed(what, "no JSON object with \"outputs\" (" + trim(r.body.substr(0, std::min(json_size, kQuoted))) + ")");
  std::map<std::string, Tensor> tensors;
  std::size_t offset = json_size;
  for (const auto& o : reply["outputs"]) {
    if (!o.is_object() || !o.contains("name") || !o["name"].is_string()) malformed(what, "an output without a name");
    Tensor t;
    t.datatype = o.value("datatype", "");
    if (o.contains("shape") && o["shape"].is_array())
      for (const auto& d : o["shape"]) t.shape.push_back(d.is_number_integer() ? d.get<long long>() : -1);
    const json* size = nullptr;
    if (o.contains("parameters") && o["parameters"].is_object() && o["parameters"].contains("binary_data_size"))
      size = &o["parameters"]["binary_data_size"];
    if (size) {
      if (!size->is_number_unsigned() && !(size->is_number_integer() && size->get<long long>() >= 0))
        malformed(what, "a bad binary_data_size");
      t.binary_size = size->get<std::size_t>();
      if (t.binary_size > r.body.size() - offset) malformed(what, "binary data past the end of the body");
      t.binary = r.body.data() + offset;
      offset += t.binary_size;
    } else if (o.contains("data") && o["data"].is_array()) {
      t.data = &o["data"];
    } else {
      malformed(what, "output " + o["name"].get<std::string>() + " has neither data nor binary_data_size");
    }
    tensors[o["name"].get<std::string>()] = t;
  }
  if (offset != r.body.size())
    malformed(what, std::to_string(r.body.size() - offset) + " bytes after the last binary output");

  // one tensor's values, checked against its datatype and element count
  auto values = [&](const char* name, const char* datatype, std::size_t count, auto sample) {
    using T = decltype(sample);
    auto it = tensors.find(name);
    if (it == tensors.end()) malformed(what, std::string("no ") + name + " output");
    const Tensor& t = it->second;
    if (t.datatype != datatype) malformed(what, std::string(name) + " is " + t.datatype + ", expected " + datatype);
    std::vector<T> v;
    v.reserve(count);
    if (t.binary) {
      std::size_t es = element_size(datatype);
      if (t.binary_size != count * es)
        malformed(what, std::string(name) + " has " + std::to_string(t.binary_size) + " bytes, expected " +
                            std::to_string(count * es));
      for (std::size_t i = 0; i < count; ++i) {
        if constexpr (std::is_same_v<T, std::uint8_t>) v.push_back(t.binary[i] != 0);
        else v.push_back(read_le<T>(t.binary + i * es));
      }
    } else {
      if (t.data->size() != count)
        malformed(what, std::string(name) + " has " + std::to_string(t.data->size()) + " values, expected " +
                            std::to_string(count));
      for (const auto& x : *t.data) {
        if constexpr (std::is_same_v<T, std::uint8_t>) {
          if (!x.is_boolean()) malformed(what, std::string(name) + " holds a non-boolean");
          v.push_back(x.get<bool>());
        } else {
          if (!x.is_number()) malformed(what, std::string(name) + " holds a non-number");
          v.push_back(x.get<T>());
        }
      }
    }
    return v;
  };
  const Tensor& e = tensors.count(kEmbedding) ? tensors[kEmbedding] : Tensor{};
  if (e.shape.size() != 2 || e.shape[0] != static_cast<long long>(n) || e.shape[1] <= 0)
    malformed(what, std::string(kEmbedding) + " has shape " + json(e.shape).dump() + ", expected [" +
                        std::to_string(n) + ", D]");
  std::size_t d = static_cast<std::size_t>(e.shape[1]);
  if (out.dim && out.dim != d) malformed(what, "rows of " + std::to_string(d) + " floats after rows of " +
                                                   std::to_string(out.dim));
  std::vector<float> rows = values(kEmbedding, "FP32", n * d, float{});
  std::vector<std::int64_t> tokens = values(kNumTokens, "INT64", n, std::int64_t{});
  std::vector<std::uint8_t> cut = values(kTruncated, "BOOL", n, std::uint8_t{});
  out.dim = d;
  out.values.insert(out.values.end(), rows.begin(), rows.end());
  out.num_tokens.insert(out.num_tokens.end(), tokens.begin(), tokens.end());
  out.truncated.insert(out.truncated.end(), cut.begin(), cut.end());
}

TritonEmbedder::TritonEmbedder(const std::string& url, std::string model, std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>(url, std::move(model), timeout)) {}
TritonEmbedder::~TritonEmbedder() = default;
TritonEmbedder::TritonEmbedder(TritonEmbedder&&) noexcept = default;
TritonEmbedder& TritonEmbedder::operator=(TritonEmbedder&&) noexcept = default;

const std::string& TritonEmbedder::url() const noexcept { return impl_->url; }
const std::string& TritonEmbedder::model() const noexcept { return impl_->model; }
void TritonEmbedder::check_ready() { impl_->check_ready(); }

std::size_t TritonEmbedder::max_batch() {
  impl_->read_config();
  return impl_->max_batch;
}

Embeddings TritonEmbedder::embed(const std::vector<std::string>& texts) {
  Embeddings out;
  if (texts.empty()) return out;
  std::size_t step = max_batch();
  for (std::size_t lo = 0; lo < texts.size(); lo += step)
    impl_->infer(texts.data() + lo, std::min(step, texts.size() - lo), out);
  return out;
}

}  // namespace mbert
