// The README's example (kept identical to it, and built, so the README's code compiles):
//   mbert-embed-example [http://HOST:PORT [MODEL]]
#include <mbert/triton_embedder.hpp>   // link: target_link_libraries(app PRIVATE mbert_client)
#include <iostream>

int main(int argc, char** argv) {
  try {
    // one client per thread: it owns one libcurl handle, whose connection every call reuses
    mbert::TritonEmbedder client(argc > 1 ? argv[1] : "http://127.0.0.1:8000",
                                 argc > 2 ? argv[2] : "gte-modernbert-base",
                                 std::chrono::seconds(30));       // per-request timeout
    mbert::Embeddings e = client.embed({"a query", "a document"});  // split by max_batch_size
    for (std::size_t i = 0; i < e.size(); ++i)
      std::cout << "text " << i << ": " << e.dim << " floats, first " << e.row(i)[0]
                << ", " << e.num_tokens[i] << " tokens"
                << (e.truncated[i] ? " (cut to the maximum length)" : "") << "\n";
  } catch (const mbert::Error& err) {  // server down, timeout, model not ready, HTTP 4xx/5xx, bad reply
    std::cerr << mbert::to_string(err.kind()) << ": " << err.what() << "\n";   // the server's message
    return 1;
  }
}
