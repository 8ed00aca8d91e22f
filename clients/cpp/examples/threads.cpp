// mbert-embed-threads: THREADS threads, each with its own mbert::TritonEmbedder (the library's rule:
// a client is not shared), all sending one-text requests at once.
//   mbert-embed-threads --url URL --model NAME --threads N --requests M TEXT...
//       thread t's request r embeds TEXT (7 t + r) mod the number of TEXTs (the concurrency test);
//   mbert-embed-threads --url URL --model NAME --threads N --queue TEXT...
//       every TEXT once: each thread takes the next unsent one until none is left (the benchmark).
// Prints one JSON line per request, in (thread, request) order: {"thread": t, "request": r, "text": k,
// "ms": latency, "truncated": b, "embedding": [...]}, or with "error": "..." instead of the last two;
// then on stderr {"requests": n, "failed": f, "wall_s": s} (first request sent to last answer).
// Exits 1 if any request failed, 2 on usage.
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "mbert/triton_embedder.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Answer {
  std::size_t text = 0;
  double ms = 0;
  bool truncated = false;
  std::vector<float> embedding;
  std::string error;
};

}  // namespace

int main(int argc, char** argv) {
  std::string url, model;
  long threads = 0, requests = 0;
  bool queue = false;
  std::vector<std::string> texts;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    bool has_value = i + 1 < argc;
    if (a == "--url" && has_value) url = argv[++i];
    else if (a == "--model" && has_value) model = argv[++i];
    else if (a == "--threads" && has_value) threads = std::strtol(argv[++i], nullptr, 10);
    else if (a == "--requests" && has_value) requests = std::strtol(argv[++i], nullptr, 10);
    else if (a == "--queue") queue = true;
    else texts.push_back(a);
  }
  if (url.empty() || model.empty() || threads <= 0 || (requests <= 0) == !queue || texts.empty()) {
    std::cerr << "usage: mbert-embed-threads --url URL --model NAME --threads N (--requests M | --queue) TEXT...\n";
    return 2;
  }
  try {
    mbert::TritonEmbedder check(url, model);  // a bad URL is refused here, not inside a thread
  } catch (const mbert::Error& err) {
    std::cerr << "mbert-embed-threads: " << err.what() << "\n";
    return 2;
  }
  std::vector<std::vector<Answer>> answers(threads);
  std::atomic<std::size_t> cursor{0};
  std::vector<std::thread> pool;
  auto start = Clock::now();
  for (long t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      mbert::TritonEmbedder client(url, model);  // this thread's own client and connection
      for (long r = 0; queue || r < requests; ++r) {
        Answer a;
        if (queue) {
          a.text = cursor.fetch_add(1);
          if (a.text >= texts.size()) break;
        } else {
          a.text = static_cast<std::size_t>(7 * t + r) % texts.size();
        }
        auto t0 = Clock::now();
        try {
          mbert::Embeddings e = client.embed({texts[a.text]});
          a.embedding.assign(e.row(0), e.row(0) + e.dim);
          a.truncated = e.truncated[0] != 0;
        } catch (const std::exception& err) {
          a.error = err.what();
        }
        a.ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        answers[t].push_back(std::move(a));
      }
    });
  }
  for (auto& th : pool) th.join();
  double wall = std::chrono::duration<double>(Clock::now() - start).count();
  std::size_t failed = 0, total = 0;
  for (long t = 0; t < threads; ++t)
    for (std::size_t r = 0; r < answers[t].size(); ++r) {
      const Answer& a = answers[t][r];
      nlohmann::json line = {{"thread", t}, {"request", r}, {"text", a.text}, {"ms", a.ms}};
      if (a.error.empty()) {
        line["truncated"] = a.truncated;
        line["embedding"] = a.embedding;
      } else {
        line["error"] = a.error;
        ++failed;
      }
      ++total;
      std::cout << line.dump() << "\n";
    }
  std::cerr << nlohmann::json{{"requests", total}, {"failed", failed}, {"wall_s", wall}}.dump() << "\n";
  return failed ? 1 : 0;
}
