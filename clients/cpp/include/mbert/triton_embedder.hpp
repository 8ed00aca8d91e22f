// mbert::TritonEmbedder: sentence embeddings from a bundle served by Triton (`mbert-run serve BUNDLE`),
// over the KServe v2 HTTP protocol. The bundle's ensemble tokenizes on the server, so the client sends
// text and needs no tokenizer.
//
//   mbert::TritonEmbedder client("http://127.0.0.1:8000", "my-bundle");
//   mbert::Embeddings e = client.embed({"a query", "a document"});
//   const float* first = e.row(0);             // e.dim floats
//   bool cut = e.truncated[1];                 // text 1 was cut to the bundle's maximum length
//
// Wire format: TEXT goes as a BYTES tensor in the binary tensor data extension (4-byte little-endian
// length, then the UTF-8 bytes, per text); `sentence_embedding` comes back as raw little-endian float32
// bytes after the JSON header (`"binary_data": true`, `Inference-Header-Content-Length`); `num_tokens`
// and `truncated` come back as JSON. Requests hold at most the model's `max_batch_size` texts (read from
// the model's config on first use); longer lists are split and the rows joined in order.
//
// Errors: every failure is an mbert::Error whose what() names the URL and model and carries the
// server's own message (the `error` field of Triton's JSON reply) where there is one; kind() tells
// them apart (server down, timeout, model not ready, HTTP 4xx/5xx, malformed reply, bad input or URL).
//
// Threads: a client is NOT safe to share between threads. It owns one libcurl easy handle, whose
// connection is kept alive and reused by every call on that client; give each thread its own client
// (construction makes no request, so clients are cheap). Different clients may be used concurrently.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace mbert {

enum class ErrorKind {
  InvalidUrl,         // the URL is not http(s)://HOST[:PORT]
  InvalidInput,       // a text the client refuses before sending (over 4 GiB)
  Connection,         // nothing answers at the URL (refused, unreachable, reset)
  Timeout,            // no complete reply within the client's timeout
  NotReady,           // the server answers, the model is unknown or not ready
  Http,               // the server refused a request: HTTP 4xx / 5xx (http_status())
  MalformedResponse,  // a reply this client cannot read (bad JSON, missing output, wrong size)
};

const char* to_string(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message, long http_status = 0);
  ErrorKind kind() const noexcept { return kind_; }
  long http_status() const noexcept { return http_status_; }  // 0 when no HTTP reply came

 private:
  ErrorKind kind_;
  long http_status_;
};

// The rows of one embed() call, in the order of its texts.
struct Embeddings {
  std::size_t dim = 0;                   // floats per row
  std::vector<float> values;             // size() * dim floats, row-major
  std::vector<std::int64_t> num_tokens;  // tokens per text after truncation (special tokens included)
  std::vector<std::uint8_t> truncated;   // 1 where the text was cut to the maximum length

  std::size_t size() const noexcept { return num_tokens.size(); }
  const float* row(std::size_t i) const { return values.data() + i * dim; }
};

class TritonEmbedder {
 public:
  // url: http://HOST:PORT of Triton's HTTP endpoint (what `mbert-run serve` prints); model: the bundle's
  // ensemble (its name); timeout: for each HTTP request, connecting included. Throws Error(InvalidUrl).
  TritonEmbedder(const std::string& url, std::string model,
                 std::chrono::milliseconds timeout = std::chrono::seconds(60));
  ~TritonEmbedder();
  TritonEmbedder(TritonEmbedder&&) noexcept;
  TritonEmbedder& operator=(TritonEmbedder&&) noexcept;
  TritonEmbedder(const TritonEmbedder&) = delete;
  TritonEmbedder& operator=(const TritonEmbedder&) = delete;

  const std::string& url() const noexcept;
  const std::string& model() const noexcept;

  // The model is ready (GET /v2/models/MODEL/ready), else Error(NotReady) with the server's message.
  void check_ready();
  // The model's max_batch_size (from its config; fetched once, after check_ready()).
  std::size_t max_batch();
  // Embeds texts (UTF-8; an empty text is embedded as [CLS] [SEP], as the runtime does). An empty list
  // makes no request.
  Embeddings embed(const std::vector<std::string>& texts);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mbert
