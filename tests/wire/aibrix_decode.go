// Decodes an agent's answer the way AIBrix's ModelClaim controller does: Go's encoding/json
// into typed structs, written here from the field table in aibrix-wire.md (our own words, not
// the controller's code). A JSON number with a fraction in an integer field, a string where a
// bool belongs, or a time that is not RFC 3339 fails the whole decode, as it fails there.
//
// Usage: aibrix_decode KIND < body.json   (KIND: activate | operation | models | snapshot)
// Exit 0 and "ok" when it decodes; exit 1 and Go's error otherwise.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"time"
)

type claimRef struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	UID       string `json:"uid"`
}

type activateResponse struct {
	Status    string `json:"status"`
	ModelName string `json:"model_name"`
	Port      int32  `json:"port"`
	IPCName   string `json:"ipc_name"`
	Message   string `json:"message,omitempty"`
}

type operationResponse struct {
	Status      string `json:"status"`
	ModelName   string `json:"model_name"`
	OperationID string `json:"operation_id"`
	Applied     bool   `json:"applied"`
	Phase       string `json:"phase"`
}

type modelInfo struct {
	ModelName    string `json:"model_name"`
	Port         int32  `json:"port"`
	IPCName      string `json:"ipc_name"`
	Phase        string `json:"phase"`
	Ready        bool   `json:"ready"`
	KVUsedBytes  int64  `json:"kv_used_bytes,omitempty"`
	KVTotalBytes int64  `json:"kv_total_bytes,omitempty"`
}

type modelList struct {
	Models []modelInfo `json:"models"`
}

type accelerator struct {
	ID             string `json:"id"`
	HBMTotalBytes  int64  `json:"hbm_total_bytes"`
	HBMFreeBytes   int64  `json:"hbm_free_bytes"`
	HBMUsableBytes int64  `json:"hbm_usable_bytes"`
}

type snapshotModel struct {
	ModelName              string     `json:"model_name"`
	ArtifactURL            string     `json:"artifact_url"`
	ClaimRef               *claimRef  `json:"claim_ref,omitempty"`
	Port                   int32      `json:"port"`
	IPCName                string     `json:"ipc_name"`
	Phase                  string     `json:"phase"`
	Alive                  bool       `json:"alive"`
	Ready                  bool       `json:"ready"`
	RestartCount           int        `json:"restart_count"`
	LastError              string     `json:"last_error,omitempty"`
	LastTransition         *time.Time `json:"last_transition,omitempty"`
	KVUsedBytes            int64      `json:"kv_used_bytes"`
	KVCapacityBytes        int64      `json:"kv_capacity_bytes"`
	HBMPeakBytes           int64      `json:"hbm_peak_bytes"`
	RequestMetricsObserved bool       `json:"request_metrics_observed"`
	RequestsRunning        int64      `json:"requests_running"`
	RequestsWaiting        int64      `json:"requests_waiting"`
	RequestSuccessTotal    *int64     `json:"request_success_total,omitempty"`
}

type snapshot struct {
	ObservedAt      time.Time       `json:"observed_at"`
	Accelerators    []accelerator   `json:"accelerators"`
	Models          []snapshotModel `json:"models"`
	CachedArtifacts []string        `json:"cached_artifacts"`
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: aibrix_decode activate|operation|models|snapshot < body.json")
		os.Exit(2)
	}
	body, err := io.ReadAll(os.Stdin)
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	var out any
	switch os.Args[1] {
	case "activate":
		out = &activateResponse{}
	case "operation":
		out = &operationResponse{}
	case "models":
		out = &modelList{}
	case "snapshot":
		out = &snapshot{}
	default:
		fmt.Fprintln(os.Stderr, "unknown kind", os.Args[1])
		os.Exit(2)
	}
	if err := json.Unmarshal(body, out); err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	fmt.Println("ok")
}
